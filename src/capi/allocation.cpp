// The C API: allocators (create, init, backends), allocation, the cache and
// its limits, statistics, configuration, streams and PyTorch's allocator hooks.
#include "capi.hpp"

#include <ccalloc/base/printable_text.hpp>
#include <ccalloc/base/detail/pointer_text.hpp>
#include <ccalloc/core/history.hpp>
#include <ccalloc/core/snapshot.hpp>
#include <ccalloc/core/tags.hpp>

#include <ccalloc/backend/default_backend.hpp>
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#ifndef CCALLOC_HAVE_CUDA_BACKEND  // set by CMake (CCALLOC_WITH_CUDA)
#define CCALLOC_HAVE_CUDA_BACKEND 0
#endif
#if CCALLOC_HAVE_CUDA_BACKEND
#include <ccalloc/backend/cuda_backend.hpp>
#endif

#ifndef CCALLOC_VERSION_STRING  // set by CMake (project version)
#define CCALLOC_VERSION_STRING "unknown"
#endif

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_set>
#include <new>
#include <string>
#include <string_view>
#include <vector>

namespace ccalloc::capi_detail {

std::atomic<bool> custom_segment_pools{false};
thread_local segment_failure tls_segment_failure;

}  // namespace ccalloc::capi_detail

using namespace ccalloc::capi_detail;  // NOLINT(google-build-using-namespace)

namespace {

/// The statistics' names, in to_map() (sorted) order, built once.
const std::vector<std::string>& stat_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const auto& [key, value] : ccalloc::device_stats{}.to_map()) out.push_back(key);
    return out;
  }();
  return names;
}

/// The text appended to an out-of-memory message after a segment allocator failed.
std::string segment_failure_note(const segment_failure& f) {
  return "; the segment allocator of private pool " + ccalloc::to_string(f.pool) + " of device " +
         std::to_string(f.device) +
         (f.code != 0 ? " returned " + std::to_string(f.code)
                      : std::string(" returned 0 with a NULL pointer")) +
         " (any failure of a segment allocator counts as out of memory)";
}

/// allocate_noting_segment_failures once a pool has a segment allocator.
template <typename Allocate>
[[gnu::noinline]] void* allocate_tracking_segment_failures(Allocate allocate) {
  // Saved and restored: an out-of-memory observer may allocate meanwhile.
  const segment_failure saved = tls_segment_failure;
  tls_segment_failure = {};
  try {
    void* ptr = allocate();
    tls_segment_failure = saved;
    return ptr;
  } catch (const ccalloc::out_of_memory_error& e) {
    const segment_failure mine = tls_segment_failure;
    tls_segment_failure = saved;
    if (!mine.set) throw;
    const ccalloc::out_of_memory_error::figures f{e.device,          e.requested_bytes, e.device_total_bytes,
                                                  e.device_free_bytes, e.allocated_bytes, e.reserved_bytes};
    throw ccalloc::out_of_memory_error(std::string(e.what()) + segment_failure_note(mine), f);
  } catch (...) {
    tls_segment_failure = saved;
    throw;
  }
}

/// Runs `allocate` (returns the pointer). When it throws out_of_memory_error
/// after a pool's segment malloc failed during the call, the message gets the
/// code that malloc returned (segment_failure_note). Inline, and `allocate`
/// with it (mark the lambda always_inline): until a pool has a segment
/// allocator, one relaxed load and the call. The slow path takes a copy of
/// the closure, and the lambdas capture the arguments by value: otherwise
/// the caller stores the closure and the arguments to memory before the
/// test, on the fast path too.
template <typename Allocate>
[[gnu::always_inline]] inline void* allocate_noting_segment_failures(Allocate&& allocate) {
  if (!custom_segment_pools.load(std::memory_order_relaxed)) [[likely]]
    return allocate();
  return allocate_tracking_segment_failures(allocate);
}


std::shared_ptr<ccalloc::device_backend> make_backend(const ccalloc_options_t& o) {
  // Read as an int: a C caller may store any value in the enum field, and
  // loading a value outside the enumerators as the enum type is undefined in C++.
  int kind = 0;
  static_assert(sizeof kind == sizeof o.backend);
  std::memcpy(&kind, &o.backend, sizeof kind);
  switch (kind) {
    case CCALLOC_BACKEND_DEFAULT:
      return ccalloc::make_default_backend();
    case CCALLOC_BACKEND_SIM: {
      ccalloc::sim_options sim;
      sim.device_count = o.sim_device_count;
      if (o.sim_capacity_bytes != 0) sim.capacity_bytes = o.sim_capacity_bytes;
      return std::make_shared<ccalloc::sim_backend>(sim);
    }
    case CCALLOC_BACKEND_CUDA:
#if CCALLOC_HAVE_CUDA_BACKEND
      if (const std::string why = ccalloc::cuda_backend::runtime_load_error(); !why.empty())
        throw ccalloc::backend_error("ccalloc: ccalloc_create: CCALLOC_BACKEND_CUDA asked, but " + why);
      if (ccalloc::cuda_backend::available_device_count() < 1)
        throw ccalloc::backend_error(
            "ccalloc: ccalloc_create: CCALLOC_BACKEND_CUDA asked, but the CUDA runtime sees no GPU");
      return std::make_shared<ccalloc::cuda_backend>();
#else
      throw ccalloc::backend_error(
          "ccalloc: ccalloc_create: CCALLOC_BACKEND_CUDA asked, but this library was built without the CUDA backend "
          "(CCALLOC_WITH_CUDA=OFF)");
#endif
  }
  throw ccalloc::invalid_argument_error("ccalloc: ccalloc_create: unknown backend kind " +
                                        std::to_string(kind) +
                                        " (accepted: CCALLOC_BACKEND_DEFAULT 0, _SIM 1, _CUDA 2)");
}

}  // namespace

extern "C" {

// ---- allocators ------------------------------------------------------------------------

void ccalloc_options_init(ccalloc_options_t* options) {
  if (options == nullptr) return;
  *options = ccalloc_options_t{};
  options->struct_size = sizeof(ccalloc_options_t);
  options->backend = CCALLOC_BACKEND_DEFAULT;
  options->sim_device_count = 1;
  options->sim_capacity_bytes = 0;
  options->config = nullptr;
}

ccalloc_status_t ccalloc_create(const ccalloc_options_t* options, ccalloc_allocator_t** out) {
  return guarded([&] {
    require(out, "ccalloc_create", "out");
    ccalloc_options_t o;
    ccalloc_options_init(&o);
    if (options != nullptr) {
      // Fields past what the caller's struct_size covers keep their defaults.
      if (options->struct_size < offsetof(ccalloc_options_t, backend) + sizeof(o.backend) ||
          options->struct_size > sizeof(ccalloc_options_t))
        throw ccalloc::invalid_argument_error(
            "ccalloc: ccalloc_create: options->struct_size is " + std::to_string(options->struct_size) +
            "; call ccalloc_options_init(&options) before setting fields (expected up to " +
            std::to_string(sizeof(ccalloc_options_t)) + ")");
      std::memcpy(&o, options, options->struct_size);
    }
    if (o.sim_device_count < 1 || o.sim_device_count > CCALLOC_MAX_DEVICE_COUNT)
      throw ccalloc::invalid_argument_error("ccalloc: ccalloc_create: sim_device_count is " +
                                            std::to_string(o.sim_device_count) + "; it must be from 1 to " +
                                            std::to_string(CCALLOC_MAX_DEVICE_COUNT) +
                                            " (CCALLOC_MAX_DEVICE_COUNT)");
    auto handle = std::make_unique<ccalloc_allocator>();
    handle->backend = make_backend(o);
    handle->backend_name = handle->backend->name();
    if (o.config == nullptr) {
      handle->allocator = std::make_unique<caching_allocator>(handle->backend);
    } else {
      ccalloc::allocator_config config = ccalloc::allocator_config::parse(o.config);
      for (const std::string& w : config.warnings) std::fprintf(stderr, "ccalloc: warning: %s\n", w.c_str());
      handle->allocator = std::make_unique<caching_allocator>(handle->backend, std::move(config));
    }
    *out = handle.release();
  });
}

void ccalloc_destroy(ccalloc_allocator_t* alloc) { delete alloc; }

ccalloc_status_t ccalloc_init(ccalloc_allocator_t* alloc, int device_count) {
  return guarded([&] { resolve(alloc).init(device_count); });
}

ccalloc_status_t ccalloc_initialized(ccalloc_allocator_t* alloc, int* out) {
  return guarded([&] {
    require(out, "ccalloc_initialized", "out");
    *out = resolve(alloc).initialized() ? 1 : 0;
  });
}

ccalloc_status_t ccalloc_device_count(ccalloc_allocator_t* alloc, int* out) {
  return guarded([&] {
    require(out, "ccalloc_device_count", "out");
    *out = resolve(alloc).backend().device_count();
  });
}

ccalloc_status_t ccalloc_backend_name(ccalloc_allocator_t* alloc, const char** out) {
  return guarded([&] {
    require(out, "ccalloc_backend_name", "out");
    if (alloc != nullptr) {
      *out = alloc->backend_name.c_str();
      return;
    }
    static const std::string global_name = ccalloc::global_allocator().backend().name();
    *out = global_name.c_str();
  });
}

ccalloc_status_t ccalloc_current_device(ccalloc_allocator_t* alloc, int* out) {
  return guarded([&] {
    require(out, "ccalloc_current_device", "out");
    *out = resolve(alloc).backend().current_device();
  });
}

ccalloc_status_t ccalloc_mem_get_info(ccalloc_allocator_t* alloc, int device, size_t* free_bytes,
                                      size_t* total_bytes) {
  return guarded([&] {
    require(free_bytes, "ccalloc_mem_get_info", "free_bytes");
    require(total_bytes, "ccalloc_mem_get_info", "total_bytes");
    caching_allocator& a = resolve(alloc);
    if (device < 0 || device >= a.backend().device_count())
      throw ccalloc::invalid_argument_error("ccalloc: ccalloc_mem_get_info: device " + std::to_string(device) +
                                            " is out of range (the backend has " +
                                            std::to_string(a.backend().device_count()) + " device(s))");
    const ccalloc::memory_info info = a.backend().mem_get_info(device);
    *free_bytes = info.free_bytes;
    *total_bytes = info.total_bytes;
  });
}

// ---- allocation ----------------------------------------------------------------------------

ccalloc_status_t ccalloc_malloc(ccalloc_allocator_t* alloc, int device, size_t size_bytes, ccalloc_stream_t stream,
                                void** out) {
  return guarded([&] {
    require(out, "ccalloc_malloc", "out");
    caching_allocator& a = resolve(alloc);
    *out = allocate_noting_segment_failures([&a, device, size_bytes, stream]() __attribute__((always_inline)) {
      return a.malloc(device, size_bytes, to_stream(stream));
    });
  });
}

ccalloc_status_t ccalloc_delete(ccalloc_allocator_t* alloc, void* ptr) {
  return guarded([&] { resolve(alloc).free(ptr); });
}

ccalloc_status_t ccalloc_raw_alloc(ccalloc_allocator_t* alloc, size_t size_bytes, void** out) {
  return guarded([&] {
    require(out, "ccalloc_raw_alloc", "out");
    caching_allocator& a = resolve(alloc);
    *out = allocate_noting_segment_failures([&a, size_bytes]() __attribute__((always_inline)) {
      return a.raw_alloc(size_bytes);
    });
  });
}

ccalloc_status_t ccalloc_raw_alloc_with_stream(ccalloc_allocator_t* alloc, size_t size_bytes,
                                               ccalloc_stream_t stream, void** out) {
  return guarded([&] {
    require(out, "ccalloc_raw_alloc_with_stream", "out");
    caching_allocator& a = resolve(alloc);
    *out = allocate_noting_segment_failures([&a, size_bytes, stream]() __attribute__((always_inline)) {
      return a.raw_alloc_with_stream(size_bytes, to_stream(stream));
    });
  });
}

void ccalloc_set_current_stream(ccalloc_stream_t stream) { caching_allocator::set_current_stream(to_stream(stream)); }
ccalloc_stream_t ccalloc_current_stream(void) { return from_stream(caching_allocator::current_stream()); }

ccalloc_status_t ccalloc_record_stream(ccalloc_allocator_t* alloc, void* ptr, ccalloc_stream_t stream) {
  return guarded([&] { resolve(alloc).record_stream(ptr, to_stream(stream)); });
}

ccalloc_status_t ccalloc_get_base_allocation(ccalloc_allocator_t* alloc, void* ptr, void** base,
                                             size_t* size_bytes) {
  return guarded([&] {
    require(base, "ccalloc_get_base_allocation", "base");
    require(size_bytes, "ccalloc_get_base_allocation", "size_bytes");
    const auto [b, size] = resolve(alloc).get_base_allocation(ptr);
    *base = b;
    *size_bytes = size;
  });
}

// ---- cache and limits --------------------------------------------------------------------------

ccalloc_status_t ccalloc_empty_cache(ccalloc_allocator_t* alloc) {
  return guarded([&] { resolve(alloc).empty_cache(); });
}

ccalloc_status_t ccalloc_cache_info(ccalloc_allocator_t* alloc, int device, size_t* largest_block_bytes) {
  return guarded([&] {
    require(largest_block_bytes, "ccalloc_cache_info", "largest_block_bytes");
    *largest_block_bytes = resolve(alloc).cache_info(device);
  });
}

ccalloc_status_t ccalloc_set_memory_fraction(ccalloc_allocator_t* alloc, int device, double fraction) {
  return guarded([&] { resolve(alloc).set_memory_fraction(fraction, device); });
}

ccalloc_status_t ccalloc_get_memory_fraction(ccalloc_allocator_t* alloc, int device, double* out) {
  return guarded([&] {
    require(out, "ccalloc_get_memory_fraction", "out");
    *out = resolve(alloc).get_memory_fraction(device);
  });
}

ccalloc_status_t ccalloc_enable(ccalloc_allocator_t* alloc, int enabled) {
  return guarded([&] { resolve(alloc).enable(enabled != 0); });
}

ccalloc_status_t ccalloc_is_enabled(ccalloc_allocator_t* alloc, int* out) {
  return guarded([&] {
    require(out, "ccalloc_is_enabled", "out");
    *out = resolve(alloc).is_enabled() ? 1 : 0;
  });
}

// ---- statistics -------------------------------------------------------------------------------------

size_t ccalloc_stat_count(void) {
  try {
    return stat_names().size();
  } catch (...) {
    return 0;  // host memory exhausted on first use
  }
}

const char* ccalloc_stat_name(size_t index) {
  try {
    const auto& names = stat_names();
    return index < names.size() ? names[index].c_str() : nullptr;
  } catch (...) {
    return nullptr;
  }
}

ccalloc_status_t ccalloc_get_device_stats(ccalloc_allocator_t* alloc, int device, int64_t* values,
                                          size_t capacity) {
  return guarded([&] {
    require(values, "ccalloc_get_device_stats", "values");
    const std::size_t count = stat_names().size();
    if (capacity < count)
      throw ccalloc::invalid_argument_error("ccalloc: ccalloc_get_device_stats: capacity " +
                                            std::to_string(capacity) +
                                            " is less than ccalloc_stat_count() = " + std::to_string(count));
    const auto map = resolve(alloc).get_device_stats(device).to_map();
    std::size_t i = 0;
    for (const auto& [key, value] : map) values[i++] = value;  // same keys, same (sorted) order
  });
}

ccalloc_status_t ccalloc_get_device_stat(ccalloc_allocator_t* alloc, int device, const char* name, int64_t* out) {
  return guarded([&] {
    require(name, "ccalloc_get_device_stat", "name");
    require(out, "ccalloc_get_device_stat", "out");
    const auto map = resolve(alloc).get_device_stats(device).to_map();
    const auto it = map.find(name);
    if (it == map.end())
      throw ccalloc::invalid_argument_error(std::string("ccalloc: ccalloc_get_device_stat: unknown statistic '") +
                                            ccalloc::printable_text(name) +
                                            "' (names as torch.cuda.memory_stats(), e.g. "
                                            "'reserved_bytes.all.peak'; see ccalloc_stat_name)");
    *out = it->second;
  });
}

ccalloc_status_t ccalloc_reset_accumulated_stats(ccalloc_allocator_t* alloc, int device) {
  return guarded([&] { resolve(alloc).reset_accumulated_stats(device); });
}

ccalloc_status_t ccalloc_reset_peak_stats(ccalloc_allocator_t* alloc, int device) {
  return guarded([&] { resolve(alloc).reset_peak_stats(device); });
}

// ---- configuration --------------------------------------------------------------------------------------

ccalloc_status_t ccalloc_set_config(ccalloc_allocator_t* alloc, const char* text) {
  return guarded([&] {
    require(text, "ccalloc_set_config", "text");
    resolve(alloc).set_config(text);
  });
}

ccalloc_status_t ccalloc_get_config(ccalloc_allocator_t* alloc, char* buffer, size_t capacity, size_t* length) {
  return guarded([&] {
    require(length, "ccalloc_get_config", "length");
    if (capacity > 0) require(buffer, "ccalloc_get_config", "buffer (with capacity > 0)");
    const caching_allocator& a = resolve(alloc);
    ccalloc::allocator_config config = a.config();
    // expandable_segments unset means "where the device has virtual
    // memory": the string names the value in force, as every key's.
    if (!config.expandable_segments_set) {
      config.expandable_segments = config.expandable_segments && a.backend().capabilities().virtual_memory;
      config.expandable_segments_set = true;
    }
    const std::string text = config.to_string();
    if (capacity > 0) {
      const std::size_t n = std::min(text.size(), capacity - 1);
      std::memcpy(buffer, text.data(), n);
      buffer[n] = '\0';
    }
    *length = text.size();
  });
}

// ---- streams ----------------------------------------------------------------------------------------------

ccalloc_status_t ccalloc_stream_create(ccalloc_allocator_t* alloc, int device, ccalloc_stream_t* out) {
  return guarded([&] {
    require(out, "ccalloc_stream_create", "out");
    *out = from_stream(resolve(alloc).create_stream(device));
  });
}

ccalloc_status_t ccalloc_stream_destroy(ccalloc_allocator_t* alloc, int device, ccalloc_stream_t stream) {
  return guarded([&] { resolve(alloc).destroy_stream(device, to_stream(stream)); });
}

ccalloc_status_t ccalloc_stream_synchronize(ccalloc_allocator_t* alloc, int device, ccalloc_stream_t stream) {
  return guarded([&] { resolve(alloc).backend().synchronize_stream(device, to_stream(stream)); });
}

// ---- PyTorch's CUDAPluggableAllocator signatures --------------------------------------------------------

void* ccalloc_plugin_alloc(size_t size, int device, ccalloc_stream_t stream) {
  void* ptr = nullptr;
  if (ccalloc_malloc(nullptr, device, size, stream, &ptr) != CCALLOC_OK) return nullptr;
  return ptr;
}

void ccalloc_plugin_free(void* ptr, size_t /*size*/, int /*device*/, ccalloc_stream_t /*stream*/) {
  const ccalloc_status_t status = ccalloc_delete(nullptr, ptr);
  if (status == CCALLOC_OK) return;
  // A bad CCALLOC_CONF fails every call on the process-wide allocator with
  // the same message: said once per process, not once per free.
  static std::atomic<bool> config_error_printed{false};
  if (status == CCALLOC_ERROR_CONFIG && config_error_printed.exchange(true)) return;
  std::fprintf(stderr, "%s\n", last_error_text());
}

// The deprecated names (ccalloc.h): the same functions.
void* ccalloc_alloc(size_t size, int device, ccalloc_stream_t stream) {
  return ccalloc_plugin_alloc(size, device, stream);
}

void ccalloc_free(void* ptr, size_t size, int device, ccalloc_stream_t stream) {
  ccalloc_plugin_free(ptr, size, device, stream);
}

// ---- hooks for PyTorch (these throw) --------------------------------------------------------------------

void* ccalloc_torch_alloc(size_t size, int device, ccalloc_stream_t stream) {
  caching_allocator& a = ccalloc::global_allocator();
  return allocate_noting_segment_failures([&] { return a.malloc(device, size, to_stream(stream)); });
}

void ccalloc_torch_free(void* ptr, size_t size, int device, ccalloc_stream_t stream) {
  ccalloc_plugin_free(ptr, size, device, stream);
}

void ccalloc_torch_init(int /*device_count*/) {
  // The process-wide allocator initializes every device of its backend.
  (void)ccalloc::global_allocator();
}

void ccalloc_torch_empty_cache(void) { ccalloc::global_allocator().empty_cache(); }

void ccalloc_torch_set_memory_fraction(double fraction, int device) {
  ccalloc::global_allocator().set_memory_fraction(fraction, device);
}

void* ccalloc_torch_base_alloc(void* ptr, size_t* size_bytes) {
  const auto [base, size] = ccalloc::global_allocator().get_base_allocation(ptr);
  if (size_bytes != nullptr) *size_bytes = size;
  return base;
}

void ccalloc_torch_record_stream(void* ptr, ccalloc_stream_t stream) {
  ccalloc::global_allocator().record_stream(ptr, to_stream(stream));
}

}  // extern "C"
