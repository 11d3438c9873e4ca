// bench/gpu/hw_counters.hpp: the CPU's own counters (cycles, instructions,
// branch misses, L1 data cache read misses, last-level cache misses, data
// TLB read misses) around a timed region, through Linux's perf_event_open,
// for this thread only and user space only. It explains a benchmark figure
// that moves between runs of the same binary (issue 18's mixed case: is it
// more instructions, or the same instructions taking more cycles, and where
// do the cycles go?). Where the kernel refuses (perf_event_paranoid, a
// container without the syscall, a virtual machine without a PMU) each
// counter that did not open reads as unavailable; the benchmark's timing is
// the same either way.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#if defined(__linux__)
#include <linux/perf_event.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace ccalloc::bench {

/// Six counters of the calling thread, started by start() and read by
/// stop(). Not thread-safe; one object per thread. Opening happens in the
/// constructor (a few system calls), not inside the timed region.
class hw_counters {
 public:
  static constexpr int count = 6;
  static constexpr const char* names[count] = {"cycles",     "instructions", "branch_misses",
                                               "l1d_misses", "llc_misses",   "dtlb_misses"};

  hw_counters() {
#if defined(__linux__)
    const std::uint64_t cache_read_miss = (PERF_COUNT_HW_CACHE_OP_READ << 8) | (PERF_COUNT_HW_CACHE_RESULT_MISS << 16);
    const std::uint32_t types[count] = {PERF_TYPE_HARDWARE, PERF_TYPE_HARDWARE, PERF_TYPE_HARDWARE,
                                        PERF_TYPE_HW_CACHE, PERF_TYPE_HARDWARE, PERF_TYPE_HW_CACHE};
    const std::uint64_t configs[count] = {PERF_COUNT_HW_CPU_CYCLES,
                                          PERF_COUNT_HW_INSTRUCTIONS,
                                          PERF_COUNT_HW_BRANCH_MISSES,
                                          PERF_COUNT_HW_CACHE_L1D | cache_read_miss,
                                          PERF_COUNT_HW_CACHE_MISSES,
                                          PERF_COUNT_HW_CACHE_DTLB | cache_read_miss};
    for (int i = 0; i < count; ++i) {
      perf_event_attr attr;
      std::memset(&attr, 0, sizeof attr);
      attr.size = sizeof attr;
      attr.type = types[i];
      attr.config = configs[i];
      attr.disabled = 1;
      attr.exclude_kernel = 1;
      attr.exclude_hv = 1;
      fd_[i] = static_cast<int>(syscall(SYS_perf_event_open, &attr, 0, -1, -1, 0));
    }
#endif
  }
  ~hw_counters() {
#if defined(__linux__)
    for (int fd : fd_)
      if (fd >= 0) close(fd);
#endif
  }
  hw_counters(const hw_counters&) = delete;
  hw_counters& operator=(const hw_counters&) = delete;

  /// Zeroes and enables every counter that opened.
  void start() {
#if defined(__linux__)
    for (int fd : fd_)
      if (fd >= 0) {
        ioctl(fd, PERF_EVENT_IOC_RESET, 0);
        ioctl(fd, PERF_EVENT_IOC_ENABLE, 0);
      }
#endif
  }
  /// Disables the counters and adds what they counted since start().
  void stop() {
#if defined(__linux__)
    for (int i = 0; i < count; ++i)
      if (fd_[i] >= 0) {
        ioctl(fd_[i], PERF_EVENT_IOC_DISABLE, 0);
        std::uint64_t v = 0;
        if (read(fd_[i], &v, sizeof v) == static_cast<ssize_t>(sizeof v)) total_[i] += v;
        else fd_[i] = -1;
      }
#endif
  }
  /// "name=value_per_unit ..." for the counters that opened (value divided
  /// by `units`, e.g. the steps timed); "unavailable" for the others.
  [[nodiscard]] std::string per(double units) const {
    std::string out;
    char buf[96];
    for (int i = 0; i < count; ++i) {
      if (fd_[i] >= 0) std::snprintf(buf, sizeof buf, "%s%s=%.1f", out.empty() ? "" : " ", names[i],
                                     static_cast<double>(total_[i]) / units);
      else std::snprintf(buf, sizeof buf, "%s%s=unavailable", out.empty() ? "" : " ", names[i]);
      out += buf;
    }
    return out;
  }

 private:
  int fd_[count] = {-1, -1, -1, -1, -1, -1};
  std::uint64_t total_[count] = {};
};

/// The CPU this thread runs on now (-1 where unknown).
inline int current_cpu() noexcept {
#if defined(__linux__)
  return sched_getcpu();
#else
  return -1;
#endif
}

}  // namespace ccalloc::bench
