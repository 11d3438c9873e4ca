// The device's memory accounting: the cap (memory fraction), reserved bytes
// against it and their high-water mark, and the recycling time budget.
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

// Whether `need` bytes of new pages may fit at all (rather than create pages
// until the device refuses): not more than the device or the cap, nor, for a
// large request, more than the device has free plus what this allocator
// could give back. Checked before a new reservation: a failed request leaves
// the segment counts as they were.
bool device_state::could_map(std::size_t need) {
  if (need > allowed_bytes_) return false;
  if (need >= free_memory_check_bytes) {
    std::size_t free_pages_bytes = 0;
    for (auto& [base, up] : segments_)
      if (up->expandable) free_pages_bytes += up->mapped_bytes;  // an upper bound of what unmapping frees
    if (need > backend_.mem_get_info(device_).free_bytes + free_pages_bytes) return false;
  }
  return true;
}

void device_state::raise_reserved_high_water() noexcept {
  if (reserved_bytes_ <= reserved_high_water_bytes_) return;
  reserved_high_water_bytes_ = reserved_bytes_;
  recycles_at_mark_ = 0;  // a new mark: recycling may start again (recycles_per_peak)
}

// The recycling time budget (recycle_budget.hpp; docs/design.md, "Note:
// the recycling reserve").
recycle_budget::source device_state::recycle_budget_now(bool large_peak) {
  const auto from =
      recycle_budget_.choose(policy_.config().recycle_time_percent, large_peak, [&] { return backend_.host_time_us(); });
  // choose() bounds the budget (refills) only between 1 and 99 percent: at 0
  // (recycling off, e.g. lowered by set_config) it holds what it held.
  CCALLOC_ASSERT_EXPENSIVE(policy_.config().recycle_time_percent >= 100 || policy_.config().recycle_time_percent == 0 ||
                           recycle_budget_.within_bounds(policy_.config().recycle_time_percent));
  return from;
}

void device_state::spend_recycle_time(recycle_budget::source from, std::uint64_t start_us, std::uint64_t excluded_us) {
  if (from == recycle_budget::source::none) return;
  const std::optional<std::uint64_t> now = backend_.host_time_us();
  if (!now || *now <= start_us || *now - start_us <= excluded_us) return;
  start_us += excluded_us;
  // Refill first up to now (the budget fills while recycling runs too), then spend.
  if (const std::optional<std::uint64_t> refill_at = backend_.host_time_us())
    recycle_budget_.refill(policy_.config().recycle_time_percent, *refill_at);
  recycle_budget_.spend(from, policy_.config().recycle_time_percent, static_cast<double>(*now - start_us));
  CCALLOC_ASSERT_EXPENSIVE(policy_.config().recycle_time_percent == 0 ||
                           recycle_budget_.within_bounds(policy_.config().recycle_time_percent));
}

void device_state::set_memory_fraction(double fraction, const world_lock& w) {
  if (!(fraction >= 0.0 && fraction <= 1.0))
    throw invalid_argument_error("ccalloc: memory fraction " + format_double(fraction) +
                                 " for device " + std::to_string(device_) + " is outside [0, 1]");
  // fraction x total in double: at 2^64 bytes and above (a huge simulated
  // device) the conversion would overflow; the cap is then no cap.
  const double allowed_real = fraction * static_cast<double>(device_total_bytes_);
  constexpr auto max_bytes = std::numeric_limits<std::size_t>::max();
  const std::size_t allowed = allowed_real >= static_cast<double>(max_bytes)  // 2^64 once a double
                                  ? max_bytes
                                  : static_cast<std::size_t>(allowed_real);
  // Keep reserved <= the new cap where cached memory allows it. Before the
  // cap changes: if the device fails meanwhile, the old cap stays in force.
  if (reserved_bytes_ > allowed) release_cached_blocks(w);
  fraction_ = fraction == 0.0 ? 0.0 : fraction;  // -0.0 becomes 0
  set_fraction_ = true;
  allowed_bytes_ = allowed;
}

}  // namespace ccalloc::detail
