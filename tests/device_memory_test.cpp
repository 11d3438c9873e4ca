// The device's memory accounting (src/core/detail/device_memory.hpp): the
// cap, reserved bytes, the high-water mark with its recycle count, and the
// made segment that a failed request gives back with the mark.
#include "../src/core/detail/device_memory.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace {

using ccalloc::detail::device_memory;
constexpr std::size_t gib = std::size_t{1} << 30;

// An 8 GiB device with `reserved` bytes reserved, its mark raised to them.
device_memory at_mark(std::size_t reserved) {
  device_memory m;
  m.set_total(8 * gib);
  m.add_reserved(reserved);
  m.raise_high_water();
  return m;
}

TEST(DeviceMemory, UncappedUntilAFractionIsSetThenTheCapHolds) {
  device_memory m;
  m.set_total(8 * gib);
  EXPECT_FALSE(m.capped());
  EXPECT_EQ(m.limit(), 8 * gib);
  EXPECT_DOUBLE_EQ(m.fraction(), 1.0);
  m.add_reserved(6 * gib);
  EXPECT_FALSE(m.over_cap(2 * gib));  // no cap: the device's total is not checked here
  const std::size_t half = m.allowed_for(0.5);
  EXPECT_EQ(half, 4 * gib);
  m.set_cap(0.5, half);
  EXPECT_TRUE(m.capped());
  EXPECT_EQ(m.limit(), 4 * gib);
  EXPECT_DOUBLE_EQ(m.fraction(), 0.5);
  EXPECT_TRUE(m.over_cap(0));  // 6 GiB reserved already pass 4 GiB
  m.remove_reserved(3 * gib);
  EXPECT_FALSE(m.over_cap(1 * gib));
  EXPECT_TRUE(m.over_cap(1 * gib + 1));
  m.set_cap(-0.0, 0);
  EXPECT_FALSE(std::signbit(m.fraction()));  // -0.0 is stored as 0
}

TEST(DeviceMemory, AFractionOfAHugeDeviceIsNoCap) {
  device_memory m;
  m.set_total(std::numeric_limits<std::size_t>::max());
  EXPECT_EQ(m.allowed_for(1.0), std::numeric_limits<std::size_t>::max());
  EXPECT_EQ(m.allowed_for(0.0), 0u);
}

TEST(DeviceMemory, TheMarkRisesWithReservedAndRestartsTheRecycleCount) {
  device_memory m = at_mark(2 * gib);
  EXPECT_EQ(m.high_water(), 2 * gib);
  m.note_recycle();
  m.note_recycle();
  EXPECT_EQ(m.recycles_at_mark(), 2u);
  m.remove_reserved(1 * gib);
  m.raise_high_water();  // lower: no change
  EXPECT_EQ(m.high_water(), 2 * gib);
  EXPECT_EQ(m.recycles_at_mark(), 2u);
  m.add_reserved(2 * gib);
  m.raise_high_water();
  EXPECT_EQ(m.high_water(), 3 * gib);
  EXPECT_EQ(m.recycles_at_mark(), 0u);
}

TEST(DeviceMemory, AFailedRequestsSegmentTakesTheMarkBackDown) {
  device_memory m = at_mark(2 * gib);
  m.note_recycle();
  int request = 0;
  const auto* owner = reinterpret_cast<const ccalloc::detail::alloc_params*>(&request);
  m.note_made(owner, 0x1000);  // the mark before it: 2 GiB, one recycle
  m.add_reserved(1 * gib);
  m.raise_high_water();
  EXPECT_EQ(m.high_water(), 3 * gib);
  const device_memory::made_segment made = m.take_made();
  EXPECT_EQ(made.owner, owner);
  EXPECT_EQ(made.base, 0x1000u);
  EXPECT_EQ(m.take_made().owner, nullptr);  // taken once
  m.remove_reserved(1 * gib);  // the segment went back
  m.restore_mark(made);
  EXPECT_EQ(m.high_water(), 2 * gib);
  EXPECT_EQ(m.recycles_at_mark(), 1u);
}

TEST(DeviceMemory, TheMarkStaysWhereReservedMemoryStillStandsAboveIt) {
  device_memory m = at_mark(2 * gib);
  m.note_made(nullptr, 0);
  m.add_reserved(2 * gib);  // the made segment, and more the request kept
  m.raise_high_water();
  const device_memory::made_segment made = m.take_made();
  m.remove_reserved(1 * gib);  // 3 GiB still reserved
  m.restore_mark(made);
  EXPECT_EQ(m.high_water(), 3 * gib);
  EXPECT_EQ(m.recycles_at_mark(), 0u);  // not the old mark: its count does not come back
}

}  // namespace
