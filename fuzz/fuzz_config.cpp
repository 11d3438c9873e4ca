// fuzz_config: the configuration string parser (core/config.cpp), and the
// allocator running with whatever configuration parses.
//
// Checks on every input:
//   - parse() returns or throws config_error whose message starts with
//     "ccalloc config: " and names something after it; nothing else escapes;
//   - apply() onto a non-default configuration is all or nothing: on error
//     the configuration is unchanged;
// and when the input parses:
//   - to_string() reads back to an equal configuration (config.hpp promises
//     parse(to_string()) == *this), warnings included;
//   - the field invariants written in config.hpp hold;
//   - a device_caching_allocator on a 4 GiB simulated device with that
//     configuration serves a fixed set of request sizes (or fails with
//     out_of_memory_error), hands out blocks at least as large as asked and
//     512-byte multiples, keeps its invariants, and returns every segment.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/core/config.hpp>
#include <ccalloc/core/device_caching_allocator.hpp>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace {

using namespace ccalloc;  // NOLINT: fuzz target

[[noreturn]] void violated(const std::string& what) {
  std::fprintf(stderr, "contract violated: %s\n", what.c_str());
  std::abort();
}

void check_error(const config_error& e) {
  const std::string what = e.what();
  const std::string prefix = "ccalloc config: ";
  if (what.rfind(prefix, 0) != 0 || what.size() <= prefix.size())
    violated("config_error message does not start with '" + prefix + "' and a reason: " + what);
}

void check_fields(const allocator_config& c) {
  const std::size_t unlimited = std::numeric_limits<std::size_t>::max();
  if (c.large_segment_size_bytes <= 10 * mib || c.large_segment_size_bytes % (2 * mib) != 0)
    violated("large_segment_size_bytes " + std::to_string(c.large_segment_size_bytes) + " is not an even MiB count > 10");
  if (c.max_split_size_bytes != unlimited && c.max_split_size_bytes < c.large_segment_size_bytes)
    violated("max_split_size_bytes below large_segment_size_bytes");
  if (c.max_non_split_rounding_bytes < c.large_segment_size_bytes)
    violated("max_non_split_rounding_bytes below large_segment_size_bytes");
  if (!(c.garbage_collection_threshold == 0.0 ||
        (c.garbage_collection_threshold > 0.0 && c.garbage_collection_threshold < 1.0)))
    violated("garbage_collection_threshold outside {0} u (0, 1)");
  if (!(c.per_process_memory_fraction >= 0.0 && c.per_process_memory_fraction <= 1.0))
    violated("per_process_memory_fraction outside [0, 1]");
  if (!c.memory_fraction_set && c.per_process_memory_fraction != 1.0)
    violated("a fraction other than 1 without memory_fraction_set");
  for (std::size_t d : c.roundup_power2_divisions)
    if (d != 0 && !std::has_single_bit(d)) violated("roundup_power2_divisions entry " + std::to_string(d));
  if (!std::has_single_bit(c.pinned_num_register_threads) || c.pinned_num_register_threads > 128)
    violated("pinned_num_register_threads " + std::to_string(c.pinned_num_register_threads));
  if (c.backend != "native" && c.backend != "cudaMallocAsync") violated("backend '" + c.backend + "'");
}

void check_round_trip(const allocator_config& c) {
  const std::string text = c.to_string();
  allocator_config again;
  try {
    again = allocator_config::parse(text);
  } catch (const config_error& e) {
    violated("to_string() '" + text + "' does not parse: " + e.what());
  }
  if (!(again == c)) violated("parse(to_string()) differs from the configuration; to_string() = '" + text + "'");
}

// Request sizes across every rounding and pool rule (B1, B2): tiny, small
// pool, the small/large boundary, under and over 10 MiB, large.
constexpr std::size_t request_sizes[] = {1,       511,          512,          513,     4097,
                                         mib - 1, mib,          mib + 1,      3 * mib, 10 * mib - 1,
                                         10 * mib, 33 * mib + 7, 300 * mib + 1, gib + 3};

void check_allocator(const allocator_config& parsed) {
  // Out-of-memory errors below would write a snapshot to whatever path the
  // input names (oom_snapshot): files all over the working directory.
  allocator_config c = parsed;
  c.oom_snapshot_path.clear();
  auto sim = std::make_shared<sim_backend>(sim_options{1, 4 * gib, 2 * mib});
  std::optional<device_caching_allocator> dev;
  try {
    dev.emplace(0, *sim, c);
  } catch (const config_error&) {
    return;  // a configuration the simulated device cannot serve (documented)
  }
  std::vector<allocation> live;
  for (std::size_t size : request_sizes) {
    try {
      const allocation a = dev->malloc(size, 0);
      const std::size_t got = dev->block_size(a.block);
      if (got < size || got % 512 != 0)
        violated("a request of " + std::to_string(size) + " bytes got a block of " + std::to_string(got));
      live.push_back(a);
    } catch (const out_of_memory_error&) {
    }
  }
  try {
    dev->check_invariants();
  } catch (const std::logic_error& e) {
    violated(e.what());
  }
  for (const allocation& a : live) dev->free(a.block);
  dev->empty_cache();
  if (dev->stats().reserved_bytes[0].current != 0) violated("segments left after empty_cache");
  dev.reset();
  if (sim->counters().used_bytes != 0) violated("the device still holds segments after the allocator is gone");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::optional<allocator_config> parsed;
  try {
    parsed = allocator_config::parse(text);
  } catch (const config_error& e) {
    check_error(e);
  }

  static const allocator_config base = allocator_config::parse(
      "max_split_size_mb:64,roundup_power2_divisions:[1:2,>:8],per_process_memory_fraction:0.5,"
      "garbage_collection_threshold:0.5,large_segment_size_mb:24");
  allocator_config applied = base;
  try {
    applied.apply(text);
  } catch (const config_error& e) {
    check_error(e);
    if (!(applied == base)) violated("a failed apply() changed the configuration");
  }

  if (!parsed) return 0;
  check_fields(*parsed);
  check_round_trip(*parsed);
  check_allocator(*parsed);
  return 0;
}
