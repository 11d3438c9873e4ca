// cpu_time.hpp: CPU seconds of the whole process (its threads, exited ones
// included), for tests that compare how long work takes on a machine that
// may be busy with other work (wall time would count the waits).
#pragma once

#include <ctime>

namespace ccalloc::testing {

/// CPU seconds the process has used so far (CLOCK_PROCESS_CPUTIME_ID).
inline double process_cpu_seconds() noexcept {
  timespec ts{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

}  // namespace ccalloc::testing
