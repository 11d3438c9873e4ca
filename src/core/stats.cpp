// ccalloc/core/stats.cpp: resets and the flat torch.cuda.memory_stats() view
// of device_stats.
#include <ccalloc/core/stats.hpp>

#include "detail/stat_storage.hpp"

#include <string_view>
#include <utility>

namespace ccalloc {
namespace detail {
namespace {

/// The per-pool counters, with their torch.cuda.memory_stats() names, in
/// PyTorch's order.
constexpr std::array<std::pair<std::string_view, stat_array device_stats::*>, 9> pooled_stats{{
    {"allocation", &device_stats::allocation},
    {"segment", &device_stats::segment},
    {"active", &device_stats::active},
    {"inactive_split", &device_stats::inactive_split},
    {"allocated_bytes", &device_stats::allocated_bytes},
    {"reserved_bytes", &device_stats::reserved_bytes},
    {"active_bytes", &device_stats::active_bytes},
    {"inactive_split_bytes", &device_stats::inactive_split_bytes},
    {"requested_bytes", &device_stats::requested_bytes},
}};

/// Names of the stat_group indices: stat_array[i] is "<name>.<group_names[i]>".
constexpr std::array<std::string_view, stat_group_count> group_names{"all", "small_pool",
                                                                      "large_pool"};

/// The counters that are single stats (no pools).
constexpr std::array<std::pair<std::string_view, stat device_stats::*>, 2> single_stats{{
    {"oversize_allocations", &device_stats::oversize_allocations},
    {"oversize_segments", &device_stats::oversize_segments},
}};

/// The plain event counters that reset_accumulated() zeroes (PyTorch's
/// resetAccumulatedStats).
constexpr std::array<std::pair<std::string_view, std::int64_t device_stats::*>, 12> event_counters{{
    {"num_alloc_retries", &device_stats::num_alloc_retries},
    {"num_ooms", &device_stats::num_ooms},
    {"num_sync_all_streams", &device_stats::num_sync_all_streams},
    {"num_device_alloc", &device_stats::num_device_alloc},
    {"num_device_free", &device_stats::num_device_free},
    {"num_device_synchronizations", &device_stats::num_device_synchronizations},
    {"num_pages_remapped", &device_stats::num_pages_remapped},
    {"num_pages_mapped", &device_stats::num_pages_mapped},
    {"num_pages_unmapped", &device_stats::num_pages_unmapped},
    {"bytes_moved_between_streams", &device_stats::bytes_moved_between_streams},
    {"num_stream_waits", &device_stats::num_stream_waits},
    {"num_thread_cache_hits", &device_stats::num_thread_cache_hits},
}};

/// Adds "<prefix>.current|peak|allocated|freed" for `s`.
void add_stat(std::map<std::string, std::int64_t>& out, std::string_view prefix, const stat& s) {
  std::string key(prefix);
  const auto put = [&](std::string_view field, std::int64_t value) {
    out.emplace(key + "." + std::string(field), value);
  };
  put("current", s.current);
  put("peak", s.peak);
  put("allocated", s.allocated);
  put("freed", s.freed);
}

}  // namespace
}  // namespace detail

void device_stats::reset_accumulated() noexcept {
  for (const auto& [name, member] : detail::pooled_stats) {
    for (auto& s : this->*member) s.reset_accumulated();
  }
  for (const auto& [name, member] : detail::single_stats) (this->*member).reset_accumulated();
  for (const auto& [name, member] : detail::event_counters) this->*member = 0;
}

void device_stats::reset_peak() noexcept {
  for (const auto& [name, member] : detail::pooled_stats) {
    for (auto& s : this->*member) s.reset_peak();
  }
  for (const auto& [name, member] : detail::single_stats) (this->*member).reset_peak();
}

device_stats detail::stats_as_read(const device_stats& stored) noexcept {
  device_stats out = stored;
  for (const auto& [name, member] : detail::pooled_stats) {
    stat_array& a = out.*member;
    stat& all = a[detail::all_group];
    all.allocated = 0;
    all.freed = 0;
    for (const stat_group g : {stat_group::small_pool, stat_group::large_pool}) {
      stat& s = a[static_cast<std::size_t>(g)];
      s.freed = s.allocated - s.current + s.freed;  // stored: the current value at the last reset
      all.allocated += s.allocated;
      all.freed += s.freed;
    }
  }
  return out;
}

void detail::reset_accumulated_stored(device_stats& stored) noexcept {
  stored.reset_accumulated();  // the single stats and event counters are stored as read
  for (const auto& [name, member] : detail::pooled_stats)
    for (stat& s : stored.*member) s.freed = s.current;  // freed reads allocated (0) - current + this: 0
}

std::map<std::string, std::int64_t> device_stats::to_map() const {
  std::map<std::string, std::int64_t> out;
  for (const auto& [name, member] : detail::pooled_stats) {
    const stat_array& stats = this->*member;
    for (std::size_t group = 0; group < stat_group_count; ++group) {
      detail::add_stat(out, std::string(name) + "." + std::string(detail::group_names[group]),
                       stats[group]);
    }
  }
  for (const auto& [name, member] : detail::single_stats) {
    detail::add_stat(out, name, this->*member);
  }
  for (const auto& [name, member] : detail::event_counters) out.emplace(name, this->*member);
  out.emplace("max_split_size", max_split_size);
  return out;
}

}  // namespace ccalloc
