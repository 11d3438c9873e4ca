// The device's memory accounting (device_memory.hpp) and the cap that
// set_memory_fraction sets.
#include <ccalloc/core/device_caching_allocator.hpp>

#include "detail/device_state.hpp"
#include "detail/format.hpp"

#include <ccalloc/base/detail/assert.hpp>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>

namespace ccalloc::detail {

void set_memory_fraction(device_state& d, double fraction, const world_lock& w) {
  if (!(fraction >= 0.0 && fraction <= 1.0))
    throw invalid_argument_error("ccalloc: memory fraction " + format_double(fraction) +
                                 " for device " + std::to_string(d.device()) + " is outside [0, 1]");
  const std::size_t allowed = d.memory().allowed_for(fraction);
  // Keep reserved <= the new cap where cached memory allows it. Before the
  // cap changes: if the device fails meanwhile, the old cap stays in force.
  if (d.memory().reserved() > allowed) d.segments().release_cached_blocks(w);
  d.memory().set_cap(fraction, allowed);
}

}  // namespace ccalloc::detail
