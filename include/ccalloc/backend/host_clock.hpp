// ccalloc/backend/host_clock.hpp: a modelled host clock, for backends that do
// not run on a real GPU (the simulated device) or replay a recording (the
// replay on a GPU), so that the allocator's time budgets see the time a real
// program would have taken.
//
// Why it exists: the allocator limits how much of the host's time it spends
// remapping pages (allocator_config::recycle_time_percent). On a GPU it reads
// the steady clock (device_backend::host_time_us). A replay runs a recorded
// program thousands of times faster than it ran, and the simulated device's
// virtual-memory calls cost nothing, so both would see the wrong time. This
// clock is the recording's time (set_base_us, from the trace's time_us) plus
// what the virtual-memory calls made so far would have cost on an H200
// (charge_vm_*), measured by bench/gpu/bench_vm.cpp on 2026-12-01 (docs/perf.md,
// "What a page costs"). All times are microseconds; all sizes bytes.
//
// Thread safety: none; the owner serializes calls (the simulated device under
// its own mutex, the replay from one thread).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace ccalloc {

/// Driver time per 2 MiB page of the virtual-memory calls, in microseconds,
/// measured on an H200 (CUDA 13; bench_vm, median of 32 pages x 5 runs).
struct vm_call_costs {
  static constexpr double create_us = 11.0;      ///< cuMemCreate
  static constexpr double map_us = 1.0;          ///< cuMemMap
  static constexpr double set_access_us = 27.8;  ///< cuMemSetAccess
  static constexpr double unmap_us = 18.9;       ///< cuMemUnmap
  static constexpr double release_us = 13.7;     ///< cuMemRelease
  static constexpr std::size_t page_bytes = std::size_t{2} << 20;
  /// A copy between pinned host memory and the device, bytes per
  /// microsecond: 50 GB/s, PCIe 5 x16's usual figure for cudaMemcpyAsync
  /// from pinned memory (a model, not a measurement of this machine).
  static constexpr double host_copy_bytes_per_us = 50'000.0;
};

/// The recording's time plus the modelled cost of virtual-memory calls.
class modeled_host_clock {
 public:
  /// Current time, microseconds: the latest base plus every cost charged,
  /// saturating at the largest std::uint64_t (a clock that wrapped would seem
  /// to go back, and budgets over it would never refill).
  [[nodiscard]] std::uint64_t now_us() const noexcept {
    constexpr std::uint64_t max = std::numeric_limits<std::uint64_t>::max();
    // 2^64 as a double: a charge at or past it would not convert.
    const std::uint64_t charged = charged_us_ >= 18446744073709551616.0 ? max : static_cast<std::uint64_t>(charged_us_);
    return charged > max - base_us_ ? max : base_us_ + charged;
  }
  /// Moves the base to `us` (the recording's time of the event being
  /// replayed); never back: an earlier value is ignored.
  void set_base_us(std::uint64_t us) noexcept { base_us_ = std::max(base_us_, us); }
  /// What each device_backend virtual-memory call covering `size_bytes` would
  /// have cost, charged to the clock (vm_map grants the device access too,
  /// as device_backend::vm_map does; vm_set_access is for a peer).
  void charge_vm_create(std::size_t size_bytes) noexcept { charge(vm_call_costs::create_us, size_bytes); }
  void charge_vm_release_handle(std::size_t size_bytes) noexcept { charge(vm_call_costs::release_us, size_bytes); }
  void charge_vm_map(std::size_t size_bytes) noexcept {
    charge(vm_call_costs::map_us + vm_call_costs::set_access_us, size_bytes);
  }
  void charge_vm_unmap(std::size_t size_bytes) noexcept { charge(vm_call_costs::unmap_us, size_bytes); }
  void charge_vm_set_access(std::size_t size_bytes) noexcept { charge(vm_call_costs::set_access_us, size_bytes); }
  /// A copy of `size_bytes` between pinned host memory and the device.
  void charge_host_copy(std::size_t size_bytes) noexcept {
    charged_us_ += static_cast<double>(size_bytes) / vm_call_costs::host_copy_bytes_per_us;
  }

 private:
  /// Charges `us` microseconds per page for a call covering `size_bytes`
  /// (pages of vm_call_costs::page_bytes, at least one).
  void charge(double us_per_page, std::size_t size_bytes) noexcept {
    const std::size_t pages = std::max<std::size_t>(1, (size_bytes + vm_call_costs::page_bytes - 1) /
                                                          vm_call_costs::page_bytes);
    charged_us_ += us_per_page * static_cast<double>(pages);
  }

  std::uint64_t base_us_ = 0;
  double charged_us_ = 0.0;
};

}  // namespace ccalloc
