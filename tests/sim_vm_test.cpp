// sim_vm_test.cpp: the simulated device's virtual memory and peers
// (include/ccalloc/backend/sim_backend.hpp): real reservations and page
// mappings (checked against /proc/self/maps), handle contents surviving
// unmap and remap, aliasing, capacity shared with segments, every misuse
// error with the state unchanged after it, fault injection, peer grants,
// and the destructor's cleanup of live mappings and handles.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/base/types.hpp>

#include <gtest/gtest.h>

#include <sys/mman.h>
#include <sys/resource.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using ccalloc::backend_error;
using ccalloc::mib;
using ccalloc::physical_handle_t;
using ccalloc::sim_backend;
using ccalloc::sim_options;
using ccalloc::vm_call_costs;

constexpr std::size_t granule = 2 * mib;

sim_options vm_device(std::size_t capacity_bytes = 64 * mib, int devices = 1) {
  sim_options o;
  o.device_count = devices;
  o.capacity_bytes = capacity_bytes;
  o.granularity_bytes = granule;
  return o;
}

char* at(void* base, std::size_t offset_bytes) { return static_cast<char*>(base) + offset_bytes; }

std::string pointer_text(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

// The permissions ("rw-s", "---p") of the host mapping holding `addr`, from
// /proc/self/maps; "" when nothing is mapped there.
std::string host_protection(const void* addr) {
  const auto a = reinterpret_cast<std::uintptr_t>(addr);
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    std::istringstream in(line);
    std::string range, perms;
    in >> range >> perms;
    const auto dash = range.find('-');
    const std::uintptr_t lo = std::stoull(range.substr(0, dash), nullptr, 16);
    const std::uintptr_t hi = std::stoull(range.substr(dash + 1), nullptr, 16);
    if (a >= lo && a < hi) return perms;
  }
  return "";
}

std::size_t open_fds() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

physical_handle_t create(sim_backend& sim, int device, std::size_t size_bytes) {
  physical_handle_t h = 0;
  EXPECT_TRUE(sim.vm_create(device, size_bytes, &h));
  EXPECT_NE(h, 0u);
  return h;
}

// Runs `call`, which must throw backend_error whose message contains `part`.
void expect_error(const std::function<void()>& call, const std::string& part) {
  try {
    call();
    ADD_FAILURE() << "no backend_error; expected one containing: " << part;
  } catch (const backend_error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << "message: " << e.what();
  }
}

bool same_counters(const ccalloc::sim_counters& a, const ccalloc::sim_counters& b) {
  return a.used_bytes == b.used_bytes && a.vm_creates == b.vm_creates && a.failed_vm_creates == b.failed_vm_creates &&
         a.vm_release_handles == b.vm_release_handles && a.vm_maps == b.vm_maps && a.vm_unmaps == b.vm_unmaps &&
         a.live_handles == b.live_handles && a.handle_bytes == b.handle_bytes && a.mapped_bytes == b.mapped_bytes &&
         a.live_reservations == b.live_reservations && a.reserved_address_bytes == b.reserved_address_bytes;
}

// ---- capabilities and reservations -------------------------------------------------------

TEST(SimVm, CapabilitiesFollowTheOptions) {
  sim_backend sim(vm_device());
  const auto caps = sim.capabilities();
  EXPECT_TRUE(caps.virtual_memory);
  EXPECT_TRUE(caps.peer_access);
  EXPECT_TRUE(caps.gates);
  EXPECT_TRUE(caps.ipc);
  EXPECT_TRUE(caps.ipc_vm);
  EXPECT_EQ(sim.vm_granularity(0), granule);

  sim_options small = vm_device();
  small.granularity_bytes = 64 * 1024;
  EXPECT_EQ(sim_backend(small).vm_granularity(0), 64u * 1024);

  // Below the host page size the memory file cannot be mapped: no VM.
  sim_options tiny = vm_device();
  tiny.granularity_bytes = 512;
  tiny.peer_access = false;
  sim_backend no_vm(tiny);
  EXPECT_FALSE(no_vm.capabilities().virtual_memory);
  EXPECT_FALSE(no_vm.capabilities().peer_access);
  expect_error([&] { (void)no_vm.vm_granularity(0); }, "vm_granularity is not supported by the 'sim' backend");
  expect_error([&] { (void)no_vm.vm_reserve(0, 4096); }, "vm_reserve is not supported by the 'sim' backend");
  physical_handle_t h = 0;
  expect_error([&] { (void)no_vm.vm_create(0, 4096, &h); }, "vm_create is not supported");
  expect_error([&] { no_vm.vm_map(0, nullptr, 4096, 1); }, "vm_map is not supported");
  expect_error([&] { no_vm.vm_unmap(0, nullptr, 4096); }, "vm_unmap is not supported");
}

// The host clock of the allocator's time budgets (host_clock.hpp): none by
// default; modeled = set_host_time_us's base plus each virtual-memory call's
// H200 cost per page; steady = the steady clock plus that cost.
TEST(SimVm, TheHostClockChargesVirtualMemoryCallsAtAnH200sCost) {
  EXPECT_FALSE(sim_backend(vm_device()).host_time_us().has_value()) << "no clock by default";

  sim_options o = vm_device();
  o.host_clock_mode = sim_options::host_clock::modeled;
  sim_backend sim(o);
  EXPECT_EQ(sim.host_time_us(), 0u);
  sim.set_host_time_us(1000);
  EXPECT_EQ(sim.host_time_us(), 1000u);
  sim.set_host_time_us(500);  // never back
  EXPECT_EQ(sim.host_time_us(), 1000u);
  void* base = sim.vm_reserve(0, 4 * granule);
  physical_handle_t h = 0;
  ASSERT_TRUE(sim.vm_create(0, 2 * granule, &h));  // two pages
  double expect = 1000 + 2 * vm_call_costs::create_us;
  EXPECT_EQ(*sim.host_time_us(), static_cast<std::uint64_t>(expect));
  sim.vm_map(0, base, 2 * granule, h);  // map + access, per page
  expect += 2 * (vm_call_costs::map_us + vm_call_costs::set_access_us);
  EXPECT_EQ(*sim.host_time_us(), static_cast<std::uint64_t>(expect));
  sim.vm_unmap(0, base, 2 * granule);
  sim.vm_release_handle(0, h);
  expect += 2 * (vm_call_costs::unmap_us + vm_call_costs::release_us);
  EXPECT_EQ(*sim.host_time_us(), static_cast<std::uint64_t>(expect));
  sim.set_host_time_us(10'000);  // the charges stay added to a new base
  EXPECT_EQ(*sim.host_time_us(), static_cast<std::uint64_t>(10'000 + expect - 1000));
  sim.vm_release(0, base, 4 * granule);

  o.host_clock_mode = sim_options::host_clock::steady;
  sim_backend steady(o);
  const std::uint64_t t1 = *steady.host_time_us();
  steady.set_host_time_us(t1 + 1'000'000'000);  // ignored: the steady clock is the base
  const std::uint64_t t2 = *steady.host_time_us();
  EXPECT_GE(t2, t1);
  EXPECT_LT(t2 - t1, 60'000'000u) << "it did not jump to the value set";
}

// At the end of the 64-bit range the modelled clock stops rather than wrap
// back to a small time (which budgets over it would read as the clock going
// back: they would never refill). Breaker finding.
TEST(SimVm, TheModelledHostClockSaturatesAtTheLargestTime) {
  sim_options o = vm_device();
  o.host_clock_mode = sim_options::host_clock::modeled;
  sim_backend sim(o);
  constexpr std::uint64_t max = std::numeric_limits<std::uint64_t>::max();
  sim.set_host_time_us(max - 5);
  void* base = sim.vm_reserve(0, granule);
  physical_handle_t h = 0;
  ASSERT_TRUE(sim.vm_create(0, granule, &h));  // 11 us: past the end
  EXPECT_EQ(sim.host_time_us(), max);
  sim.vm_release_handle(0, h);
  EXPECT_EQ(sim.host_time_us(), max);
  sim.vm_release(0, base, granule);
}

// Reservations go top down in the backend's own order: below the lowest it
// placed, stepping over another mapping of the process that sits there, or
// into the slot a released one left; never into a gap that opened above
// because of another mapping. So which of two reservations is lower (the
// best fit's tie-break between equal free blocks) depends on this backend's
// calls alone: two replays in one process place their blocks as one alone
// does (ReplayLayout).
TEST(SimVm, ReservationsGoTopDownInTheBackendsOwnOrder) {
  sim_backend sim(vm_device());
  const std::size_t size = 64 * granule;
  const auto addr = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
  void* r1 = sim.vm_reserve(0, size);
  ASSERT_NE(r1, nullptr);
  // Another thread's mapping, 16 GiB right below r1.
  constexpr std::size_t foreign_bytes = std::size_t{16} << 30;
  void* foreign = ::mmap(reinterpret_cast<void*>(addr(r1) - foreign_bytes), foreign_bytes, PROT_NONE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
  if (foreign != reinterpret_cast<void*>(addr(r1) - foreign_bytes)) {
    if (foreign != MAP_FAILED) ::munmap(foreign, foreign_bytes);
    sim.vm_release(0, r1, size);
    GTEST_SKIP() << "the host has a mapping right below the first reservation";
  }
  void* r2 = sim.vm_reserve(0, size);
  void* r3 = sim.vm_reserve(0, size);
  ::munmap(foreign, foreign_bytes);  // a gap above r2 now
  EXPECT_LT(addr(r2) + size, addr(r1) - foreign_bytes) << "below the other mapping";
  EXPECT_LT(addr(r3) + size, addr(r2));
  sim.vm_release(0, r2, size);
  void* r4 = sim.vm_reserve(0, size);
  EXPECT_EQ(r4, r2) << "into the released slot";
  void* r5 = sim.vm_reserve(0, size);
  EXPECT_LT(addr(r5) + size, addr(r3)) << "below the lowest, not into the gap the other mapping left";
  for (void* r : {r1, r3, r4, r5}) sim.vm_release(0, r, size);
  EXPECT_EQ(sim.counters().live_reservations, 0u);
}

TEST(SimVm, ReservationsAreAlignedInaccessibleAndCostNoCapacity) {
  sim_backend sim(vm_device(8 * mib));
  std::vector<void*> bases;
  for (std::size_t granules : {1, 3, 5, 64}) {  // 64 granules: more than the capacity
    void* base = sim.vm_reserve(0, granules * granule);
    ASSERT_NE(base, nullptr);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(base) % granule, 0u) << granules;
    EXPECT_EQ(host_protection(base), "---p");
    EXPECT_EQ(host_protection(at(base, granules * granule - 1)), "---p");
    bases.push_back(base);
  }
  EXPECT_EQ(sim.mem_get_info(0).free_bytes, 8 * mib);
  auto c = sim.counters();
  EXPECT_EQ(c.live_reservations, 4u);
  EXPECT_EQ(c.reserved_address_bytes, 73 * granule);
  EXPECT_EQ(c.used_bytes, 0u);

  sim.vm_release(0, bases[1], 3 * granule);
  EXPECT_EQ(host_protection(bases[1]), "");  // the address space went back
  c = sim.counters();
  EXPECT_EQ(c.live_reservations, 3u);
  EXPECT_EQ(c.reserved_address_bytes, 70 * granule);
}

TEST(SimVm, ReserveReturnsNullWhenTheAddressSpaceIsExhausted) {
  sim_backend sim(vm_device());
  // 2^62 bytes: beyond any x86-64/AArch64 user address space (mmap: ENOMEM).
  EXPECT_EQ(sim.vm_reserve(0, std::size_t{1} << 62), nullptr);
  // So large that the over-reservation for alignment would overflow.
  const std::size_t huge = std::numeric_limits<std::size_t>::max() / granule * granule;
  EXPECT_EQ(sim.vm_reserve(0, huge), nullptr);
  EXPECT_EQ(sim.counters().live_reservations, 0u);
}

// ---- mapping ----------------------------------------------------------------------------

TEST(SimVm, BytesWrittenSurviveUnmapAndRemapElsewhere) {
  sim_backend sim(vm_device());
  void* base = sim.vm_reserve(0, 4 * granule);
  ASSERT_NE(base, nullptr);
  const physical_handle_t h = create(sim, 0, 2 * granule);
  sim.vm_map(0, base, 2 * granule, h);
  EXPECT_EQ(host_protection(base), "rw-s");
  EXPECT_EQ(host_protection(at(base, 2 * granule)), "---p");  // the rest stays reserved
  for (std::size_t i = 0; i < 2 * granule; i += 4096) at(base, i)[0] = static_cast<char>(i / 4096 + 1);
  auto c = sim.counters();
  EXPECT_EQ(c.vm_maps, 1u);
  EXPECT_EQ(c.mapped_bytes, 2 * granule);

  sim.vm_unmap(0, base, 2 * granule);
  EXPECT_EQ(host_protection(base), "---p");  // reserved again, not free
  c = sim.counters();
  EXPECT_EQ(c.vm_unmaps, 1u);
  EXPECT_EQ(c.mapped_bytes, 0u);
  EXPECT_EQ(c.live_handles, 1u);
  EXPECT_EQ(c.used_bytes, 2 * granule);  // the handle keeps its capacity while unmapped

  void* second = at(base, 2 * granule);
  sim.vm_map(0, second, 2 * granule, h);
  for (std::size_t i = 0; i < 2 * granule; i += 4096)
    ASSERT_EQ(at(second, i)[0], static_cast<char>(i / 4096 + 1)) << "offset " << i;
  sim.vm_unmap(0, second, 2 * granule);
  sim.vm_release_handle(0, h);
  sim.vm_release(0, base, 4 * granule);
  c = sim.counters();
  EXPECT_EQ(c.vm_creates, 1u);
  EXPECT_EQ(c.vm_release_handles, 1u);
  EXPECT_EQ(c.live_handles, 0u);
  EXPECT_EQ(c.used_bytes, 0u);
  EXPECT_EQ(c.live_reservations, 0u);
}

TEST(SimVm, TwoMappingsOfOneHandleAlias) {
  sim_backend sim(vm_device());
  void* base = sim.vm_reserve(0, 2 * granule);
  ASSERT_NE(base, nullptr);
  const physical_handle_t h = create(sim, 0, granule);
  sim.vm_map(0, base, granule, h);
  void* alias = at(base, granule);
  sim.vm_map(0, alias, granule, h);
  std::memcpy(at(base, 12345), "written once", 13);
  EXPECT_STREQ(at(alias, 12345), "written once");
  at(alias, granule - 1)[0] = 'z';
  EXPECT_EQ(at(base, granule - 1)[0], 'z');
  const auto c = sim.counters();
  EXPECT_EQ(c.vm_maps, 2u);
  EXPECT_EQ(c.mapped_bytes, 2 * granule);
  EXPECT_EQ(c.used_bytes, granule);  // one handle's capacity, however often it is mapped
  expect_error([&] { sim.vm_release_handle(0, h); }, "still mapped 2 time(s), the first at " + pointer_text(base));
  sim.vm_unmap(0, base, 2 * granule);  // both mappings in one call
  EXPECT_EQ(sim.counters().vm_unmaps, 2u);
  sim.vm_release_handle(0, h);
  sim.vm_release(0, base, 2 * granule);
}

TEST(SimVm, UnmapAndSetAccessTakeUnionsOfWholeMappings) {
  sim_backend sim(vm_device(64 * mib, 2));
  void* base = sim.vm_reserve(0, 8 * granule);
  ASSERT_NE(base, nullptr);
  const physical_handle_t a = create(sim, 0, granule);
  const physical_handle_t b = create(sim, 0, 2 * granule);
  const physical_handle_t c = create(sim, 0, granule);
  sim.vm_map(0, base, granule, a);
  sim.vm_map(0, at(base, granule), 2 * granule, b);
  sim.vm_map(0, at(base, 4 * granule), granule, c);  // a gap at 3 granules
  const std::string gap = "nothing is mapped at " + pointer_text(at(base, 3 * granule));
  expect_error([&] { sim.vm_unmap(0, base, 5 * granule); }, gap);
  expect_error([&] { sim.vm_set_access(0, base, 5 * granule, 1); }, gap);
  expect_error([&] { sim.vm_unmap(0, base, 2 * granule); },
               "the range ends inside the mapping at " + pointer_text(at(base, granule)));
  expect_error([&] { sim.vm_unmap(0, at(base, 2 * granule), granule); }, "not at its start");
  EXPECT_EQ(sim.counters().vm_unmaps, 0u);
  EXPECT_EQ(host_protection(at(base, granule)), "rw-s");

  sim.vm_set_access(0, base, 3 * granule, 1);  // a and b
  EXPECT_TRUE(sim.peer_can_access(0, at(base, 2 * granule), 1));
  EXPECT_FALSE(sim.peer_can_access(0, at(base, 4 * granule), 1));
  sim.vm_unmap(0, base, 3 * granule);
  EXPECT_EQ(sim.counters().vm_unmaps, 2u);
  EXPECT_EQ(sim.counters().mapped_bytes, granule);
  EXPECT_EQ(host_protection(base), "---p");
  EXPECT_EQ(host_protection(at(base, 4 * granule)), "rw-s");
  sim.vm_unmap(0, at(base, 4 * granule), granule);
  for (physical_handle_t h : {a, b, c}) sim.vm_release_handle(0, h);
  sim.vm_release(0, base, 8 * granule);
}

// ---- capacity --------------------------------------------------------------------------

TEST(SimVm, SegmentsAndHandlesShareTheCapacity) {
  sim_backend sim(vm_device(10 * mib));
  void* seg = sim.segment_malloc(0, 3 * mib);  // charged 4 MiB
  ASSERT_NE(seg, nullptr);
  const physical_handle_t h1 = create(sim, 0, 4 * mib);
  EXPECT_EQ(sim.mem_get_info(0).free_bytes, 2 * mib);
  EXPECT_EQ(sim.mem_get_info(0).total_bytes, 10 * mib);

  physical_handle_t untouched = 77;
  EXPECT_FALSE(sim.vm_create(0, 4 * mib, &untouched));
  EXPECT_EQ(untouched, 77u);
  EXPECT_EQ(sim.segment_malloc(0, 4 * mib), nullptr);
  const physical_handle_t h2 = create(sim, 0, 2 * mib);
  EXPECT_NE(h2, h1);
  EXPECT_EQ(sim.mem_get_info(0).free_bytes, 0u);
  auto c = sim.counters();
  EXPECT_EQ(c.failed_vm_creates, 1u);
  EXPECT_EQ(c.failed_mallocs, 1u);
  EXPECT_EQ(c.used_bytes, 10 * mib);
  EXPECT_EQ(c.handle_bytes, 6 * mib);

  sim.vm_release_handle(0, h1);
  EXPECT_EQ(sim.mem_get_info(0).free_bytes, 4 * mib);
  void* seg2 = sim.segment_malloc(0, 4 * mib);
  EXPECT_NE(seg2, nullptr);
  sim.segment_free(0, seg);
  sim.segment_free(0, seg2);
  sim.vm_release_handle(0, h2);
  c = sim.counters();
  EXPECT_EQ(c.used_bytes, 0u);
  EXPECT_EQ(c.handle_bytes, 0u);
  EXPECT_EQ(sim.mem_get_info(0).free_bytes, 10 * mib);
}

TEST(SimVm, CapacityIsPerDevice) {
  sim_backend sim(vm_device(4 * mib, 2));
  const physical_handle_t h0 = create(sim, 0, 4 * mib);
  physical_handle_t h = 0;
  EXPECT_FALSE(sim.vm_create(0, granule, &h));
  const physical_handle_t h1 = create(sim, 1, 4 * mib);
  EXPECT_EQ(sim.mem_get_info(0).free_bytes, 0u);
  EXPECT_EQ(sim.mem_get_info(1).free_bytes, 0u);
  sim.vm_release_handle(1, h1);
  EXPECT_EQ(sim.mem_get_info(1).free_bytes, 4 * mib);
  EXPECT_EQ(sim.mem_get_info(0).free_bytes, 0u);
  sim.vm_release_handle(0, h0);
}

TEST(SimVm, ReleasedMemoryComesBackEmptyWhenItsRangeIsReused) {
  // The released handle's file range is punched out and reused: a new handle
  // of the same size there reads zeros, not the old bytes.
  sim_backend sim(vm_device(4 * mib));
  void* base = sim.vm_reserve(0, 2 * granule);
  ASSERT_NE(base, nullptr);
  for (int round = 0; round < 3; ++round) {
    const physical_handle_t h = create(sim, 0, 2 * granule);  // the whole capacity each time
    sim.vm_map(0, base, 2 * granule, h);
    for (std::size_t i = 0; i < 2 * granule; i += 4096) ASSERT_EQ(at(base, i)[0], 0) << round << " " << i;
    std::memset(base, 0xab, 2 * granule);
    sim.vm_unmap(0, base, 2 * granule);
    sim.vm_release_handle(0, h);
  }
  // Split and merged ranges: two halves, released, then one whole again.
  const physical_handle_t lo = create(sim, 0, granule);
  const physical_handle_t hi = create(sim, 0, granule);
  sim.vm_map(0, base, granule, lo);
  sim.vm_map(0, at(base, granule), granule, hi);
  std::memset(base, 0x5c, 2 * granule);
  sim.vm_unmap(0, base, 2 * granule);
  sim.vm_release_handle(0, hi);
  sim.vm_release_handle(0, lo);
  const physical_handle_t whole = create(sim, 0, 2 * granule);
  sim.vm_map(0, base, 2 * granule, whole);
  EXPECT_EQ(at(base, 0)[0], 0);
  EXPECT_EQ(at(base, 2 * granule - 1)[0], 0);
  sim.vm_unmap(0, base, 2 * granule);
  sim.vm_release_handle(0, whole);
  sim.vm_release(0, base, 2 * granule);
}

// ---- misuse -----------------------------------------------------------------------------

TEST(SimVm, MisuseThrowsNamingTheCallAndLeavesTheStateUnchanged) {
  sim_backend sim(vm_device(64 * mib, 2));
  void* base = sim.vm_reserve(0, 4 * granule);
  void* base1 = sim.vm_reserve(1, 2 * granule);
  ASSERT_NE(base, nullptr);
  ASSERT_NE(base1, nullptr);
  const physical_handle_t h = create(sim, 0, granule);
  const physical_handle_t spare = create(sim, 0, granule);
  const physical_handle_t big = create(sim, 0, 2 * granule);
  const physical_handle_t h1 = create(sim, 1, granule);
  sim.vm_map(0, base, granule, h);
  std::memcpy(base, "kept", 5);
  void* gone = sim.vm_reserve(0, granule);  // released at once: not a reservation any more
  sim.vm_release(0, gone, granule);
  const auto before = sim.counters();
  const auto info0 = sim.mem_get_info(0);

  // One full message, to pin its format.
  expect_error([&] { sim.vm_map(0, gone, granule, spare); },
               "sim: vm_map(device 0, " + pointer_text(gone) + ", 2097152 bytes, handle " + std::to_string(spare) +
                   "): address is not inside a reservation");
  // Sizes and alignment.
  expect_error([&] { (void)sim.vm_reserve(0, 0); }, "sim: vm_reserve(device 0, 0 bytes): size must be > 0");
  expect_error([&] { (void)sim.vm_reserve(0, granule + 4096); },
               "is not a multiple of the granularity (2097152 bytes)");
  expect_error([&] { sim.vm_map(0, at(base, 4096), granule, spare); }, "address is not aligned to the granularity");
  expect_error([&] { sim.vm_map(0, at(base, granule), granule + 4096, spare); }, "not a multiple of the granularity");
  expect_error([&] { sim.vm_map(0, at(base, granule), 0, spare); }, "size must be > 0");
  physical_handle_t out = 0;
  expect_error([&] { (void)sim.vm_create(0, 4096, &out); }, "sim: vm_create(device 0, 4096 bytes): size is not");
  expect_error([&] { (void)sim.vm_create(0, 0, &out); }, "size must be > 0");
  expect_error([&] { (void)sim.vm_create(0, granule, nullptr); }, "handle is null");
  // Placement.
  expect_error([&] { sim.vm_map(0, at(base, 3 * granule), 2 * granule, big); },
               "range passes the end of the reservation at " + pointer_text(base));
  expect_error([&] { sim.vm_map(0, base, granule, spare); }, "range overlaps the mapping at " + pointer_text(base));
  expect_error([&] { sim.vm_map(0, at(base, granule), granule, big); }, "size differs from the handle's 4194304 bytes");
  expect_error([&] { sim.vm_unmap(0, at(base, granule), granule); },
               "sim: vm_unmap(device 0, " + pointer_text(at(base, granule)) + ", 2097152 bytes): nothing is mapped at");
  expect_error([&] { sim.vm_set_access(0, at(base, granule), granule, 1); }, "nothing is mapped at");
  // Releases.
  expect_error([&] { sim.vm_release_handle(0, h); }, "the handle is still mapped 1 time(s)");
  expect_error([&] { sim.vm_release(0, base, 4 * granule); },
               "1 mapping(s) still inside, the first at " + pointer_text(base) + " (vm_unmap them first)");
  expect_error([&] { sim.vm_release(0, base, 2 * granule); }, "size differs from the reservation's 8388608 bytes");
  expect_error([&] { sim.vm_release(0, at(base, granule), granule); }, "not at its base");
  expect_error([&] { sim.vm_release(0, gone, granule); }, "address is not a live reservation");
  // Unknown handles.
  expect_error([&] { sim.vm_map(0, at(base, granule), granule, 9999); }, "unknown handle");
  expect_error([&] { sim.vm_release_handle(0, 9999); },
               "sim: vm_release_handle(device 0, handle 9999): unknown handle (never created or already released)");
  // Wrong device.
  expect_error([&] { sim.vm_map(0, at(base, granule), granule, h1); }, "the handle belongs to device 1");
  expect_error([&] { sim.vm_map(1, at(base, granule), granule, h1); }, "address is inside a reservation of device 0");
  expect_error([&] { sim.vm_unmap(1, base, granule); },
               "the mapping at " + pointer_text(base) + " belongs to device 0");
  expect_error([&] { sim.vm_release_handle(1, spare); }, "the handle belongs to device 0");
  expect_error([&] { sim.vm_release(1, base, 4 * granule); }, "the reservation belongs to device 0");
  expect_error([&] { (void)sim.vm_reserve(2, granule); }, "sim: device 2 out of range [0, 2)");
  expect_error([&] { sim.vm_set_access(0, base, granule, 2); }, "peer out of range [0, 2)");

  const auto after = sim.counters();
  EXPECT_TRUE(same_counters(before, after));
  EXPECT_EQ(sim.mem_get_info(0).free_bytes, info0.free_bytes);
  EXPECT_STREQ(static_cast<char*>(base), "kept");
  EXPECT_EQ(host_protection(at(base, granule)), "---p");
  EXPECT_FALSE(sim.peer_can_access(0, base, 1));
  // Everything still works after the errors.
  sim.vm_map(0, at(base, granule), granule, spare);
  sim.vm_map(0, at(base, 2 * granule), 2 * granule, big);
  sim.vm_unmap(0, base, 4 * granule);
  for (physical_handle_t x : {h, spare, big}) sim.vm_release_handle(0, x);
  sim.vm_release_handle(1, h1);
  sim.vm_release(0, base, 4 * granule);
  sim.vm_release(1, base1, 2 * granule);
  EXPECT_EQ(sim.counters().used_bytes, 0u);
  EXPECT_EQ(sim.counters().live_reservations, 0u);
}

// ---- fault injection --------------------------------------------------------------------

TEST(SimVm, InjectedFaults) {
  sim_backend sim(vm_device());
  void* base = sim.vm_reserve(0, 2 * granule);
  ASSERT_NE(base, nullptr);

  sim.fail_vm_create_after(2);
  const physical_handle_t h = create(sim, 0, granule);
  physical_handle_t untouched = 5;
  expect_error([&] { (void)sim.vm_create(0, 4096, &untouched); }, "not a multiple");  // bad arguments do not count
  EXPECT_FALSE(sim.vm_create(0, granule, &untouched));  // the 2nd counted call
  EXPECT_EQ(untouched, 5u);
  EXPECT_EQ(sim.counters().failed_vm_creates, 1u);
  EXPECT_EQ(sim.counters().used_bytes, granule);
  const physical_handle_t h2 = create(sim, 0, granule);  // fired once, then disarmed

  sim.fail_vm_map_after(1);
  expect_error([&] { sim.vm_map(0, at(base, 4096), granule, h); }, "not aligned");  // does not count
  expect_error([&] { sim.vm_map(0, base, granule, h); },
               "sim: vm_map(device 0, " + pointer_text(base) + ", 2097152 bytes, handle " + std::to_string(h) +
                   "): injected failure");
  EXPECT_EQ(host_protection(base), "---p");  // nothing mapped
  EXPECT_EQ(sim.counters().vm_maps, 0u);
  expect_error([&] { sim.vm_unmap(0, base, granule); }, "nothing is mapped at");
  sim.vm_release_handle(0, h);  // not mapped, so it can go
  sim.vm_map(0, base, granule, h2);
  at(base, 0)[0] = 1;
  EXPECT_EQ(sim.counters().vm_maps, 1u);

  sim.fail_vm_map_after(2);
  sim.fail_vm_map_after(0);  // disarmed
  const physical_handle_t h3 = create(sim, 0, granule);
  sim.vm_map(0, at(base, granule), granule, h3);
  sim.vm_unmap(0, base, 2 * granule);
  sim.vm_release_handle(0, h2);
  sim.vm_release_handle(0, h3);
  sim.vm_release(0, base, 2 * granule);
}

// fail_vm_unmap_after(n, count): the n-th vm_unmap and the count - 1 after
// it are refused (a refusal and its retries), then the device unmaps again.
TEST(SimVm, InjectedUnmapRefusalsInARow) {
  sim_backend sim(vm_device());
  void* base = sim.vm_reserve(0, 3 * granule);
  ASSERT_NE(base, nullptr);
  std::vector<physical_handle_t> hs;
  for (std::size_t i = 0; i < 3; ++i) {
    hs.push_back(create(sim, 0, granule));
    sim.vm_map(0, at(base, i * granule), granule, hs.back());
  }
  sim.fail_vm_unmap_after(2, 2);
  sim.vm_unmap(0, base, granule);  // the 1st
  expect_error([&] { sim.vm_unmap(0, base, granule); }, "nothing is mapped at");  // bad arguments do not count
  for (int refused = 0; refused < 2; ++refused)  // the 2nd and the one after it
    expect_error([&] { sim.vm_unmap(0, at(base, granule), granule); }, "injected failure");
  EXPECT_EQ(sim.counters().vm_unmaps, 1u);
  EXPECT_EQ(sim.counters().mapped_bytes, 2 * granule);
  sim.vm_unmap(0, at(base, granule), granule);  // the 4th: disarmed
  sim.fail_vm_unmap_after(1, 0);  // count 0 disarms
  sim.vm_unmap(0, at(base, 2 * granule), granule);
  EXPECT_EQ(sim.counters().vm_unmaps, 3u);
  EXPECT_EQ(sim.counters().mapped_bytes, 0u);
  for (physical_handle_t h : hs) sim.vm_release_handle(0, h);
  sim.vm_release(0, base, 3 * granule);
}

// An address-space limit below what the process maps already (RLIMIT_AS
// lowered at run time) refuses every mmap, even one that only replaces a
// range: vm_unmap still unmaps (the range stays taken, inaccessible), so
// that the allocator's books and the device agree, and vm_map there works
// again once the limit is lifted. Before, vm_unmap threw and the mapping
// stayed; the allocator, which gives a page back whatever the device says,
// then failed every later vm_map of that page ("range overlaps").
TEST(SimVm, UnmapWorksOverTheAddressSpaceLimit) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "a sanitizer's runtime maps memory of its own under the limit";
#endif
  sim_backend sim(vm_device());
  void* base = sim.vm_reserve(0, 2 * granule);
  ASSERT_NE(base, nullptr);
  const physical_handle_t h = create(sim, 0, granule);
  const physical_handle_t h2 = create(sim, 0, granule);
  sim.vm_map(0, base, granule, h);
  sim.vm_map(0, at(base, granule), granule, h2);
  at(base, 0)[0] = 7;
  rlimit before{};
  ASSERT_EQ(::getrlimit(RLIMIT_AS, &before), 0);
  rlimit low = before;
  low.rlim_cur = 4096;  // far below what the process maps: every mmap fails
  ASSERT_EQ(::setrlimit(RLIMIT_AS, &low), 0);
  const bool mmap_refused =
      ::mmap(nullptr, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0) == MAP_FAILED;
  bool unmapped = true;
  try {
    sim.vm_unmap(0, base, granule);
  } catch (const backend_error&) {
    unmapped = false;
  }
  ASSERT_EQ(::setrlimit(RLIMIT_AS, &before), 0);
  EXPECT_TRUE(mmap_refused);
  EXPECT_TRUE(unmapped);
  EXPECT_EQ(host_protection(base).substr(0, 3), "---");  // inaccessible, and the range still taken
  EXPECT_EQ(sim.counters().mapped_bytes, granule);
  sim.vm_release_handle(0, h);
  const physical_handle_t h3 = create(sim, 0, granule);
  sim.vm_map(0, base, granule, h3);  // replaces what the limit left
  EXPECT_EQ(host_protection(base), "rw-s");
  EXPECT_EQ(at(base, 0)[0], 0);  // the new handle's memory, not the old one's
  sim.vm_unmap(0, base, 2 * granule);
  EXPECT_EQ(host_protection(base), "---p");
  sim.vm_release_handle(0, h2);
  sim.vm_release_handle(0, h3);
  sim.vm_release(0, base, 2 * granule);
}

// A vm_map refused under an address-space limit names that limit, with
// what the process maps (the hint named only vm.max_map_count); without a
// limit set, a refusal names vm.max_map_count.
TEST(SimVm, MapRefusedByTheAddressSpaceLimitNamesIt) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "a sanitizer's runtime maps memory of its own under the limit";
#endif
  sim_backend sim(vm_device());
  void* base = sim.vm_reserve(0, granule);
  ASSERT_NE(base, nullptr);
  const physical_handle_t h = create(sim, 0, granule);
  rlimit before{};
  ASSERT_EQ(::getrlimit(RLIMIT_AS, &before), 0);
  rlimit low = before;
  low.rlim_cur = 4096;  // far below what the process maps: every mmap fails
  std::string what;
  ASSERT_EQ(::setrlimit(RLIMIT_AS, &low), 0);
  try {
    sim.vm_map(0, base, granule, h);
  } catch (const backend_error& e) {
    what = e.what();
  }
  ASSERT_EQ(::setrlimit(RLIMIT_AS, &before), 0);
  EXPECT_NE(what.find("): mmap failed: Cannot allocate memory (the process maps "), std::string::npos) << what;
  EXPECT_NE(what.find(" bytes, and " + std::to_string(granule) +
                      " more pass its address-space limit RLIMIT_AS (ulimit -v) of 4096 bytes: raise the limit)"),
            std::string::npos)
      << what;
  EXPECT_EQ(what.find("max_map_count"), std::string::npos) << what;
  EXPECT_EQ(sim.counters().mapped_bytes, 0u);
  sim.vm_map(0, base, granule, h);  // the limit lifted: it maps
  sim.vm_unmap(0, base, granule);
  sim.vm_release_handle(0, h);
  sim.vm_release(0, base, granule);
}

// ---- peers ------------------------------------------------------------------------------

TEST(SimVm, PeerAccessIsRecorded) {
  sim_backend sim(vm_device(64 * mib, 3));
  EXPECT_TRUE(sim.can_access_peer(0, 1));
  EXPECT_TRUE(sim.can_access_peer(2, 0));
  EXPECT_FALSE(sim.can_access_peer(1, 1));
  EXPECT_THROW((void)sim.can_access_peer(0, 3), backend_error);
  EXPECT_FALSE(sim.peer_access_enabled(0, 1));
  sim.enable_peer_access(0, 1);
  sim.enable_peer_access(0, 1);  // again: not an error
  EXPECT_TRUE(sim.peer_access_enabled(0, 1));
  EXPECT_FALSE(sim.peer_access_enabled(1, 0));
  expect_error([&] { sim.enable_peer_access(1, 1); },
               "sim: enable_peer_access(device 1, peer 1): a device cannot enable peer access to itself");
  expect_error([&] { sim.enable_peer_access(1, -1); }, "sim: device -1 out of range [0, 3)");

  void* base = sim.vm_reserve(1, 2 * granule);
  ASSERT_NE(base, nullptr);
  const physical_handle_t h = create(sim, 1, granule);
  sim.vm_map(1, base, granule, h);
  EXPECT_TRUE(sim.peer_can_access(1, at(base, 100), 1));  // vm_map grants the device itself
  EXPECT_FALSE(sim.peer_can_access(1, at(base, 100), 0));
  EXPECT_FALSE(sim.peer_can_access(0, at(base, 100), 0));  // not a mapping of device 0
  sim.vm_set_access(1, base, granule, 0);
  sim.vm_set_access(1, base, granule, 0);  // again: no change
  sim.vm_set_access(1, base, granule, 1);  // the device itself: no change
  EXPECT_TRUE(sim.peer_can_access(1, at(base, granule - 1), 0));
  EXPECT_FALSE(sim.peer_can_access(1, at(base, 100), 2));
  EXPECT_FALSE(sim.peer_can_access(1, at(base, granule), 0));  // reserved, not mapped
  // A grant ends with its mapping.
  sim.vm_unmap(1, base, granule);
  EXPECT_FALSE(sim.peer_can_access(1, base, 0));
  sim.vm_map(1, base, granule, h);
  EXPECT_FALSE(sim.peer_can_access(1, base, 0));
  sim.vm_unmap(1, base, granule);
  sim.vm_release_handle(1, h);
  sim.vm_release(1, base, 2 * granule);
}

TEST(SimVm, PeerAccessCanBeSwitchedOff) {
  sim_options o = vm_device(64 * mib, 2);
  o.peer_access = false;
  sim_backend sim(o);
  EXPECT_FALSE(sim.capabilities().peer_access);
  EXPECT_TRUE(sim.capabilities().virtual_memory);
  EXPECT_FALSE(sim.can_access_peer(0, 1));
  expect_error([&] { sim.enable_peer_access(0, 1); }, "enable_peer_access is not supported by the 'sim' backend");
  void* base = sim.vm_reserve(0, granule);
  ASSERT_NE(base, nullptr);
  const physical_handle_t h = create(sim, 0, granule);
  sim.vm_map(0, base, granule, h);
  expect_error([&] { sim.vm_set_access(0, base, granule, 1); }, "peer access is off (sim_options::peer_access)");
  sim.vm_set_access(0, base, granule, 0);  // the device itself is always fine
  EXPECT_FALSE(sim.peer_can_access(0, base, 1));
  sim.vm_unmap(0, base, granule);
  sim.vm_release_handle(0, h);
  sim.vm_release(0, base, granule);
}

// ---- lifetime and threads ---------------------------------------------------------------

TEST(SimVm, DestructorReleasesLiveMappingsHandlesAndReservations) {
  const std::size_t fds_before = open_fds();
  void* base = nullptr;
  {
    sim_backend sim(vm_device(64 * mib, 2));
    base = sim.vm_reserve(0, 8 * granule);
    ASSERT_NE(base, nullptr);
    for (std::size_t i = 0; i < 4; ++i) {
      const physical_handle_t h = create(sim, 0, granule);
      sim.vm_map(0, at(base, i * granule), granule, h);
      std::memset(at(base, i * granule), 1, granule);
    }
    (void)create(sim, 0, 2 * granule);  // live but never mapped
    (void)create(sim, 1, granule);      // a second device's memory file
    EXPECT_EQ(host_protection(base), "rw-s");
    EXPECT_EQ(open_fds(), fds_before + 2);  // one memory file per device
  }
  EXPECT_EQ(host_protection(base), "");
  EXPECT_EQ(host_protection(at(base, 7 * granule)), "");
  EXPECT_EQ(open_fds(), fds_before);
}

TEST(SimVm, ConcurrentGrowAndShrinkOnSeparateReservations) {
  sim_backend sim(vm_device(64 * mib, 2));
  constexpr int threads = 4;
  constexpr int rounds = 50;
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      const int device = t % 2;
      void* base = sim.vm_reserve(device, 4 * granule);
      ASSERT_NE(base, nullptr);
      for (int r = 0; r < rounds; ++r) {
        physical_handle_t hs[2] = {0, 0};
        for (std::size_t i = 0; i < 2; ++i) {
          ASSERT_TRUE(sim.vm_create(device, granule, &hs[i]));
          sim.vm_map(device, at(base, i * granule), granule, hs[i]);
          at(base, i * granule)[7] = static_cast<char>(t + r);
        }
        ASSERT_EQ(at(base, granule)[7], static_cast<char>(t + r));
        sim.vm_unmap(device, base, 2 * granule);
        for (physical_handle_t h : hs) sim.vm_release_handle(device, h);
      }
      sim.vm_release(device, base, 4 * granule);
    });
  for (auto& th : pool) th.join();
  const auto c = sim.counters();
  EXPECT_EQ(c.vm_creates, std::uint64_t{threads} * rounds * 2);
  EXPECT_EQ(c.vm_maps, c.vm_unmaps);
  EXPECT_EQ(c.live_handles, 0u);
  EXPECT_EQ(c.used_bytes, 0u);
  EXPECT_EQ(c.mapped_bytes, 0u);
  EXPECT_EQ(c.live_reservations, 0u);
}

}  // namespace
