// The C API (include/ccalloc/ccalloc.h) over the front end: every function
// turns C++ exceptions into a status code and a thread-local message.
#include <ccalloc/ccalloc.h>

#include <ccalloc/base/printable_text.hpp>
#include <ccalloc/base/detail/pointer_text.hpp>
#include <ccalloc/core/history.hpp>
#include <ccalloc/core/snapshot.hpp>
#include <ccalloc/core/tags.hpp>

#include <ccalloc/backend/default_backend.hpp>
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>
#include <ccalloc/frontend/ipc_socket.hpp>

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
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_set>
#include <new>
#include <string>
#include <span>
#include <string_view>
#include <vector>

#include <unistd.h>

/// What ccalloc_allocator_t points to: an allocator with the backend it owns.
/// The backend is declared first so that it outlives the allocator.
struct ccalloc_allocator {
  std::shared_ptr<ccalloc::device_backend> backend;
  std::unique_ptr<ccalloc::caching_allocator> allocator;
  std::string backend_name;
};

/// What ccalloc_pool_checkpoint_t points to.
struct ccalloc_pool_checkpoint {
  ccalloc::pool_checkpoint state;
};

namespace {

using ccalloc::caching_allocator;

thread_local std::string tls_last_error;

/// `message` with the prefix every C API message has, "ccalloc: " (the
/// backends' own messages start "sim: " or "cuda: ").
std::string with_prefix(std::string message) {
  if (!message.starts_with("ccalloc")) message.insert(0, "ccalloc: ");
  return message;
}

/// A front-end message as a C caller reads it: the C++ calls it names
/// (init(), init(device_count)) become the C functions to call.
std::string c_api_message(std::string message) {
  const auto replace = [&message](std::string_view from, std::string_view to) {
    const std::size_t at = message.find(from);
    if (at != std::string::npos) message.replace(at, from.size(), to);
  };
  replace(" before init(): call init(device_count) first",
          " before ccalloc_init(): call ccalloc_init(alloc, device_count) first");
  if (message.starts_with("ccalloc: init(")) message.replace(9, 5, "ccalloc_init(");
  return with_prefix(std::move(message));
}

/// Runs `body` (which returns nothing) and maps what it throws to a status,
/// storing the message for ccalloc_last_error().
/// Inlined into each entry point: ccalloc_malloc and ccalloc_delete then make
/// one call into the library's hot path, not two.
template <typename Body>
[[gnu::always_inline]] inline ccalloc_status_t guarded(Body&& body) noexcept {
  try {
    body();
    return CCALLOC_OK;
  } catch (const ccalloc::out_of_memory_error& e) {
    tls_last_error = with_prefix(e.what());
    return CCALLOC_ERROR_OUT_OF_MEMORY;
  } catch (const ccalloc::config_error& e) {
    tls_last_error = with_prefix(e.what());
    return CCALLOC_ERROR_CONFIG;
  } catch (const ccalloc::invalid_argument_error& e) {
    tls_last_error = c_api_message(e.what());
    return CCALLOC_ERROR_INVALID_ARGUMENT;
  } catch (const ccalloc::backend_error& e) {
    tls_last_error = with_prefix(e.what());
    return CCALLOC_ERROR_BACKEND;
  } catch (const std::bad_alloc&) {
    // Assigning a message may itself fail now; keep whatever fits.
    try {
      tls_last_error = "ccalloc: out of host memory inside the library";
    } catch (...) {  // no message then; the status still says out of host memory
    }
    return CCALLOC_ERROR_INTERNAL;
  } catch (const std::exception& e) {
    try {
      tls_last_error = std::string("ccalloc: internal error: ") + e.what();
    } catch (...) {  // no message then; the status still says internal error
    }
    return CCALLOC_ERROR_INTERNAL;
  } catch (...) {
    try {
      tls_last_error = "ccalloc: internal error: unknown exception";
    } catch (...) {  // no message then; the status still says internal error
    }
    return CCALLOC_ERROR_INTERNAL;
  }
}

/// The front end behind a handle; NULL is the process-wide allocator.
caching_allocator& resolve(ccalloc_allocator_t* alloc) {
  return alloc == nullptr ? ccalloc::global_allocator() : *alloc->allocator;
}

/// Throws invalid_argument_error naming `function` and `what` (a NULL argument).
[[gnu::noinline, gnu::cold, noreturn]] void throw_null(const char* function, const char* what) {
  throw ccalloc::invalid_argument_error(std::string("ccalloc: ") + function + ": " + what + " is NULL");
}

/// Throws invalid_argument_error naming `function` and `what` when `ptr` is
/// null. Inline: one test where ccalloc_malloc checks its `out`.
[[gnu::always_inline]] inline void require(const void* ptr, const char* function, const char* what) {
  if (ptr == nullptr) [[unlikely]]
    throw_null(function, what);
}

ccalloc::stream_t to_stream(ccalloc_stream_t stream) noexcept { return reinterpret_cast<ccalloc::stream_t>(stream); }
ccalloc_stream_t from_stream(ccalloc::stream_t stream) noexcept {
  return reinterpret_cast<ccalloc_stream_t>(stream);  // NOLINT(performance-no-int-to-ptr)
}

/// The statistics' names, in to_map() (sorted) order, built once.
const std::vector<std::string>& stat_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const auto& [key, value] : ccalloc::device_stats{}.to_map()) out.push_back(key);
    return out;
  }();
  return names;
}

using ccalloc::detail::pointer_text;

ccalloc::mempool_id_t to_pool_id(ccalloc_mempool_id_t id) noexcept { return {id.first, id.second}; }

// ---- pools' segment allocators --------------------------------------------------------

/// True once any pool got a segment allocator: only then do allocations
/// track segment_failure (one relaxed load otherwise).
std::atomic<bool> custom_segment_pools{false};

/// What a pool's segment malloc returned when it failed on this thread,
/// during the current allocation call: kept for the out-of-memory message.
struct segment_failure {
  bool set = false;
  int code = 0;
  int device = 0;
  ccalloc::mempool_id_t pool{};
};
thread_local segment_failure tls_segment_failure;

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

/// Makes `device` the calling thread's current device of `backend` while it
/// lives (cudaSetDevice), then restores the previous one. Throws
/// backend_error if the device cannot be made current.
class current_device_guard {
 public:
  current_device_guard(ccalloc::device_backend& backend, int device)
      : backend_(backend), previous_(backend.current_device()) {
    if (previous_ != device) {
      backend_.set_device(device);
      changed_ = true;
    }
  }
  ~current_device_guard() {
    if (!changed_) return;
    try {
      backend_.set_device(previous_);
    } catch (...) {  // the previous device was valid a moment ago; nothing to report to
    }
  }
  current_device_guard(const current_device_guard&) = delete;
  current_device_guard& operator=(const current_device_guard&) = delete;

 private:
  ccalloc::device_backend& backend_;
  int previous_;
  bool changed_ = false;
};

/// A pool's C segment allocator as the core's segment_allocator: each call
/// runs with `device` current; a failed malloc is nullptr (the core's
/// out-of-memory path) and leaves its code in tls_segment_failure; a failed
/// free is a backend_error. `backend` outlives the allocator that holds the
/// functions (ccalloc_allocator declares it first; the process-wide one is
/// never destroyed).
ccalloc::segment_allocator wrap_segment_allocator(ccalloc::device_backend& backend, int device,
                                                  ccalloc::mempool_id_t pool,
                                                  std::function<int(void**, std::size_t)> malloc_fn,
                                                  std::function<int(void*)> free_fn) {
  ccalloc::segment_allocator out;
  out.malloc = [&backend, device, pool, malloc_fn, free_fn](std::size_t size_bytes) -> void* {
    void* ptr = nullptr;
    int code = 0;
    {
      current_device_guard current(backend, device);
      code = malloc_fn(&ptr, size_bytes);
    }
    if (code != 0 || ptr == nullptr) {
      tls_segment_failure = {true, code, device, pool};
      return nullptr;
    }
    if (reinterpret_cast<std::uintptr_t>(ptr) % 512 != 0) {
      {
        current_device_guard current(backend, device);
        (void)free_fn(ptr);
      }
      throw ccalloc::backend_error("ccalloc: the segment allocator of private pool " + ccalloc::to_string(pool) +
                                   " of device " + std::to_string(device) + " returned " + pointer_text(ptr) +
                                   ", which is not aligned to 512 bytes (given back)");
    }
    return ptr;
  };
  out.free = [&backend, device, pool, free_fn](void* ptr) {
    int code = 0;
    {
      current_device_guard current(backend, device);
      code = free_fn(ptr);
    }
    if (code != 0)
      throw ccalloc::backend_error("ccalloc: the segment allocator of private pool " + ccalloc::to_string(pool) +
                                   " of device " + std::to_string(device) + " failed to free " +
                                   pointer_text(ptr) + ": its free returned " + std::to_string(code) +
                                   " (the segment stays cached in the pool)");
  };
  return out;
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

namespace {

// ---- inter-process sharing: the C copies of an ipc_export

/// Copies `ex` into library memory in *out; the descriptors move to *out.
void to_c_export(const ccalloc::ipc_export& ex, ccalloc_ipc_export_t* out) {
  auto* handle = static_cast<char*>(std::malloc(ex.handle.size() == 0 ? 1 : ex.handle.size()));
  auto* fds = static_cast<int*>(std::malloc(ex.fds.empty() ? sizeof(int) : ex.fds.size() * sizeof(int)));
  if (handle == nullptr || fds == nullptr) {
    std::free(handle);
    std::free(fds);
    throw std::bad_alloc();
  }
  std::memcpy(handle, ex.handle.data(), ex.handle.size());
  if (!ex.fds.empty()) std::memcpy(fds, ex.fds.data(), ex.fds.size() * sizeof(int));
  *out = ccalloc_ipc_export_t{handle, ex.handle.size(), fds, ex.fds.size()};
}

/// Runs `share` (which returns an ipc_export) and moves its result into
/// *out; closes the descriptors when that fails.
template <typename Share>
void share_into(ccalloc_ipc_export_t* out, const char* function, Share&& share) {
  require(out, function, "out");
  ccalloc::ipc_export ex = share();
  try {
    to_c_export(ex, out);
  } catch (...) {
    for (int fd : ex.fds) ::close(fd);
    throw;
  }
}

}  // namespace

extern "C" {

// ---- errors and identity -----------------------------------------------------------

const char* ccalloc_last_error(void) { return tls_last_error.c_str(); }

const char* ccalloc_status_name(ccalloc_status_t status) {
  switch (status) {
    case CCALLOC_OK: return "CCALLOC_OK";
    case CCALLOC_ERROR_INVALID_ARGUMENT: return "CCALLOC_ERROR_INVALID_ARGUMENT";
    case CCALLOC_ERROR_OUT_OF_MEMORY: return "CCALLOC_ERROR_OUT_OF_MEMORY";
    case CCALLOC_ERROR_CONFIG: return "CCALLOC_ERROR_CONFIG";
    case CCALLOC_ERROR_BACKEND: return "CCALLOC_ERROR_BACKEND";
    case CCALLOC_ERROR_INTERNAL: return "CCALLOC_ERROR_INTERNAL";
  }
  return "CCALLOC_STATUS_UNKNOWN";
}

const char* ccalloc_name(void) { return "ccalloc"; }
const char* ccalloc_version(void) { return CCALLOC_VERSION_STRING; }
int ccalloc_built_with_cuda(void) { return ccalloc::built_with_cuda() ? 1 : 0; }

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

// ---- inter-process sharing ----------------------------------------------------------------------

ccalloc_status_t ccalloc_share_ipc_handle(ccalloc_allocator_t* alloc, void* ptr, ccalloc_ipc_export_t* out) {
  return guarded([&] { share_into(out, "ccalloc_share_ipc_handle", [&] { return resolve(alloc).share_ipc_handle(ptr); }); });
}

void ccalloc_ipc_export_free(ccalloc_ipc_export_t* ex, int close_fds) {
  if (ex == nullptr) return;
  if (close_fds != 0 && ex->fds != nullptr)
    for (std::size_t i = 0; i < ex->fd_count; ++i) ::close(ex->fds[i]);
  std::free(ex->handle);
  std::free(ex->fds);
  *ex = ccalloc_ipc_export_t{};
}

ccalloc_status_t ccalloc_send_ipc_handle(int socket, const ccalloc_ipc_export_t* ex) {
  return guarded([&] {
    require(ex, "ccalloc_send_ipc_handle", "ex");
    if (ex->handle_bytes > 0) require(ex->handle, "ccalloc_send_ipc_handle", "ex->handle");
    if (ex->fd_count > 0) require(ex->fds, "ccalloc_send_ipc_handle", "ex->fds");
    ccalloc::ipc_export copy;
    copy.handle.assign(ex->handle == nullptr ? "" : ex->handle, ex->handle_bytes);
    if (ex->fd_count > 0) copy.fds.assign(ex->fds, ex->fds + ex->fd_count);
    ccalloc::send_ipc_handle(socket, copy);
  });
}

ccalloc_status_t ccalloc_receive_ipc_handle(int socket, ccalloc_ipc_export_t* out) {
  return guarded([&] { share_into(out, "ccalloc_receive_ipc_handle", [&] { return ccalloc::receive_ipc_handle(socket); }); });
}

ccalloc_status_t ccalloc_open_ipc_handle(ccalloc_allocator_t* alloc, const void* handle, size_t handle_bytes,
                                         const int* fds, size_t fd_count, int access_device, void** out) {
  return guarded([&] {
    require(out, "ccalloc_open_ipc_handle", "out");
    require(handle, "ccalloc_open_ipc_handle", "handle");
    if (fd_count > 0) require(fds, "ccalloc_open_ipc_handle", "fds");
    *out = resolve(alloc).open_ipc_handle(std::string_view(static_cast<const char*>(handle), handle_bytes),
                                          std::span<const int>(fds, fd_count), access_device);
  });
}

ccalloc_status_t ccalloc_share_ipc_handle_pidfd(ccalloc_allocator_t* alloc, void* ptr, char* buffer,
                                                size_t capacity, size_t* length) {
  return guarded([&] {
    require(length, "ccalloc_share_ipc_handle_pidfd", "length");
    if (capacity > 0) require(buffer, "ccalloc_share_ipc_handle_pidfd", "buffer (with capacity > 0)");
    const std::string bytes = resolve(alloc).share_ipc_handle_pidfd(ptr);
    if (capacity > 0) std::memcpy(buffer, bytes.data(), std::min(bytes.size(), capacity));
    *length = bytes.size();
  });
}

ccalloc_status_t ccalloc_open_ipc_handle_pidfd(ccalloc_allocator_t* alloc, const void* bytes, size_t byte_count,
                                               int access_device, void** out) {
  return guarded([&] {
    require(out, "ccalloc_open_ipc_handle_pidfd", "out");
    require(bytes, "ccalloc_open_ipc_handle_pidfd", "bytes");
    *out = resolve(alloc).open_ipc_handle_pidfd(std::string_view(static_cast<const char*>(bytes), byte_count),
                                                access_device);
  });
}

ccalloc_status_t ccalloc_close_ipc_handle(ccalloc_allocator_t* alloc, void* ptr) {
  return guarded([&] { resolve(alloc).close_ipc_handle(ptr); });
}

ccalloc_status_t ccalloc_reclaim_ipc_exports(ccalloc_allocator_t* alloc, size_t* freed) {
  return guarded([&] {
    const std::size_t n = resolve(alloc).reclaim_ipc_exports();
    if (freed != nullptr) *freed = n;
  });
}

ccalloc_status_t ccalloc_ipc_export_status(ccalloc_allocator_t* alloc, void* ptr, size_t* importers,
                                           int* owner_freed) {
  return guarded([&] {
    for (const ccalloc::ipc_export_info& e : resolve(alloc).ipc_exports()) {
      if (e.ptr != ptr) continue;
      if (importers != nullptr) *importers = e.importers;
      if (owner_freed != nullptr) *owner_freed = e.owner_freed ? 1 : 0;
      return;
    }
    throw ccalloc::invalid_argument_error("ccalloc: ccalloc_ipc_export_status(" +
                                          ccalloc::detail::pointer_text(ptr) +
                                          "): not an exported expandable block of this allocator");
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
    const std::string text = resolve(alloc).config().to_string();
    if (capacity > 0) {
      const std::size_t n = std::min(text.size(), capacity - 1);
      std::memcpy(buffer, text.data(), n);
      buffer[n] = '\0';
    }
    *length = text.size();
  });
}

// ---- history and snapshots -------------------------------------------------------------------------------

ccalloc_status_t ccalloc_record_history(ccalloc_allocator_t* alloc, int enabled, size_t max_entries) {
  return guarded([&] {
    ccalloc::history_options o;
    o.enabled = enabled != 0;
    o.max_entries = max_entries;
    o.when = ccalloc::record_context::never;
    resolve(alloc).record_history(o);
  });
}

namespace {

/// A context handle that a C recorder returned: given back through the
/// recorder's release function with the last entry or block holding it,
/// turned into frames through its frames function when a snapshot is written.
class c_context final : public ccalloc::trace_context {
 public:
  c_context(void* handle, const ccalloc_history_options_t& fns) noexcept
      : handle_(handle), release_(fns.release), frames_(fns.frames), user_data_(fns.user_data) {}
  ~c_context() override {
    if (release_ != nullptr) release_(user_data_, handle_);
  }
  c_context(const c_context&) = delete;
  c_context& operator=(const c_context&) = delete;
  [[nodiscard]] std::vector<ccalloc::stack_frame> to_frames() const override {
    std::vector<ccalloc::stack_frame> out;
    if (frames_ != nullptr) frames_(user_data_, handle_, &sink, &out);
    return out;
  }

 private:
  static void sink(void* sink_data, const char* name, const char* filename, int64_t line) noexcept {
    try {  // nothing may unwind through the caller's C frames: a frame that does not fit is dropped
      static_cast<std::vector<ccalloc::stack_frame>*>(sink_data)->push_back(
          {name != nullptr ? name : "", filename != nullptr ? filename : "", line});
    } catch (...) {
    }
  }
  void* handle_;
  void (*release_)(void*, void*);
  void (*frames_)(void*, void*, ccalloc_frame_sink_fn, void*);
  void* user_data_;
};

/// "alloc,free_requested" as actions; throws invalid_argument_error naming an unknown one.
std::vector<ccalloc::trace_entry_action> parse_skip_actions(const char* text) {
  std::vector<ccalloc::trace_entry_action> out;
  if (text == nullptr) return out;
  std::string_view rest(text);
  while (!rest.empty()) {
    const std::size_t comma = rest.find(',');
    std::string_view name = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    while (!name.empty() && name.front() == ' ') name.remove_prefix(1);
    while (!name.empty() && name.back() == ' ') name.remove_suffix(1);
    if (name.empty()) continue;
    const auto action = ccalloc::parse_trace_entry_action(name);
    if (!action)
      throw ccalloc::invalid_argument_error(
          "ccalloc: ccalloc_record_history_ex: unknown action '" + std::string(name) +
          "' in skip_actions (accepted: alloc, free_requested, free_completed, segment_alloc, segment_free, "
          "segment_map, segment_unmap, snapshot, oom, empty_cache)");
    out.push_back(*action);
  }
  return out;
}

}  // namespace

void ccalloc_history_options_init(ccalloc_history_options_t* options) {
  if (options == nullptr) return;
  *options = ccalloc_history_options_t{};
  options->enabled = 1;
  options->max_entries = SIZE_MAX;
  options->when = CCALLOC_RECORD_CONTEXT_ALL;
}

ccalloc_status_t ccalloc_record_history_ex(ccalloc_allocator_t* alloc, const ccalloc_history_options_t* options) {
  return guarded([&] {
    require(options, "ccalloc_record_history_ex", "options");
    const ccalloc_history_options_t c = *options;
    if (c.when < CCALLOC_RECORD_CONTEXT_NEVER || c.when > CCALLOC_RECORD_CONTEXT_ALL)
      throw ccalloc::invalid_argument_error("ccalloc: ccalloc_record_history_ex: when must be 0 (never) to 3 (all), got " +
                                            std::to_string(c.when));
    ccalloc::history_options o;
    o.enabled = c.enabled != 0;
    o.max_entries = c.max_entries;
    o.when = static_cast<ccalloc::record_context>(c.when);
    o.clear = c.clear != 0;
    o.skip_actions = parse_skip_actions(c.skip_actions);
    if (c.record != nullptr) {
      o.recorder = [c]() -> ccalloc::context_ptr {
        void* handle = c.record(c.user_data);
        if (handle == nullptr) return nullptr;
        try {
          return std::make_shared<const c_context>(handle, c);
        } catch (...) {
          if (c.release != nullptr) c.release(c.user_data, handle);
          throw;
        }
      };
    }
    resolve(alloc).record_history(o);
  });
}

ccalloc_status_t ccalloc_snapshot_json(ccalloc_allocator_t* alloc, int include_traces, char* buffer,
                                       size_t capacity, size_t* length) {
  return guarded([&] {
    require(length, "ccalloc_snapshot_json", "length");
    if (capacity > 0) require(buffer, "ccalloc_snapshot_json", "buffer (with capacity > 0)");
    const std::string text = ccalloc::to_json(resolve(alloc).snapshot(include_traces != 0));
    if (capacity > 0) {
      const std::size_t n = std::min(text.size(), capacity - 1);
      std::memcpy(buffer, text.data(), n);
      buffer[n] = '\0';
    }
    *length = text.size();
  });
}

// ---- observers -------------------------------------------------------------------------------------------

ccalloc_status_t ccalloc_attach_out_of_memory_observer(ccalloc_allocator_t* alloc, ccalloc_oom_observer_fn fn,
                                                       void* user_data) {
  return guarded([&] {
    if (fn == nullptr)
      throw ccalloc::invalid_argument_error("ccalloc: ccalloc_attach_out_of_memory_observer: fn is NULL");
    resolve(alloc).attach_out_of_memory_observer(
        [fn, user_data](int device, std::size_t requested, std::size_t allowed, std::size_t free_bytes) {
          fn(user_data, device, requested, allowed, free_bytes);
        });
  });
}

ccalloc_status_t ccalloc_attach_trace_tracker(ccalloc_allocator_t* alloc, ccalloc_trace_tracker_fn fn,
                                              void* user_data) {
  return guarded([&] {
    if (fn == nullptr) throw ccalloc::invalid_argument_error("ccalloc: ccalloc_attach_trace_tracker: fn is NULL");
    resolve(alloc).attach_allocator_trace_tracker([fn, user_data](const ccalloc::trace_entry& e) {
      const ccalloc_trace_entry_t c{static_cast<ccalloc_trace_action_t>(e.action), e.device, e.addr, e.size,
                                    from_stream(e.stream), e.time_us};
      fn(user_data, &c);
    });
  });
}

ccalloc_status_t ccalloc_attach_mapping_listener(ccalloc_allocator_t* alloc, ccalloc_mapping_listener_fn fn,
                                                 void* user_data) {
  return guarded([&] {
    if (fn == nullptr) throw ccalloc::invalid_argument_error("ccalloc: ccalloc_attach_mapping_listener: fn is NULL");
    resolve(alloc).attach_mapping_listener([fn, user_data](const ccalloc::mapping_event& e) {
      const ccalloc_mapping_event_t c{static_cast<ccalloc_mapping_change_t>(e.change),
                                      static_cast<ccalloc_mapping_reason_t>(e.reason),
                                      e.device,
                                      e.expandable ? 1 : 0,
                                      e.addr,
                                      e.size_bytes,
                                      from_stream(e.stream)};
      fn(user_data, &c);
    });
  });
}
// The device bound of ccalloc.h is the C++ one.
static_assert(CCALLOC_MAX_DEVICE_COUNT == ccalloc::max_device_count, "ccalloc.h and types.hpp disagree");
// The C enums follow the C++ ones value for value.
static_assert(static_cast<int>(ccalloc::trace_entry_action::empty_cache) == CCALLOC_TRACE_EMPTY_CACHE);
static_assert(static_cast<int>(ccalloc::trace_entry_action::pause) == CCALLOC_TRACE_PAUSE);
static_assert(static_cast<int>(ccalloc::trace_entry_action::resume) == CCALLOC_TRACE_RESUME);
static_assert(static_cast<int>(ccalloc::trace_entry_action::segment_unmap) == CCALLOC_TRACE_SEGMENT_UNMAP);
static_assert(static_cast<int>(ccalloc::mapping_change::unmap_completed) == CCALLOC_MAPPING_UNMAP_COMPLETED);
static_assert(static_cast<int>(ccalloc::mapping_reason::deferred_unmap) == CCALLOC_MAPPING_DEFERRED_UNMAP);
static_assert(static_cast<int>(ccalloc::mapping_reason::pages_resumed) == CCALLOC_MAPPING_PAGES_RESUMED);
static_assert(static_cast<int>(ccalloc::mapping_reason::pages_retired) == CCALLOC_MAPPING_PAGES_RETIRED);

// ---- private pools ---------------------------------------------------------------------------------------

ccalloc_status_t ccalloc_new_pool_id(ccalloc_allocator_t* /*alloc*/, ccalloc_mempool_id_t* out) {
  return guarded([&] {
    require(out, "ccalloc_new_pool_id", "out");
    const ccalloc::mempool_id_t id = caching_allocator::new_pool_id();  // shared with C++
    *out = ccalloc_mempool_id_t{id.first, id.second};
  });
}

ccalloc_status_t ccalloc_create_pool(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id,
                                     ccalloc_segment_malloc_fn malloc_fn, ccalloc_segment_free_fn free_fn) {
  return guarded([&] {
    if ((malloc_fn == nullptr) != (free_fn == nullptr))
      throw ccalloc::invalid_argument_error(std::string("ccalloc: ccalloc_create_pool: ") +
                                            (malloc_fn == nullptr ? "malloc_fn" : "free_fn") +
                                            " is NULL but the other segment function is not; give both or neither");
    caching_allocator& a = resolve(alloc);
    const ccalloc::mempool_id_t pool = to_pool_id(id);
    ccalloc::segment_allocator custom;
    if (malloc_fn != nullptr) {
      custom = wrap_segment_allocator(a.backend(), device, pool, malloc_fn, free_fn);
      custom_segment_pools.store(true, std::memory_order_relaxed);
    }
    a.create_or_incref_pool(device, pool, std::move(custom));
  });
}

ccalloc_status_t ccalloc_release_pool(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id) {
  return guarded([&] { resolve(alloc).release_pool(device, to_pool_id(id)); });
}

ccalloc_status_t ccalloc_pool_use_count(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id, int* out) {
  return guarded([&] {
    require(out, "ccalloc_pool_use_count", "out");
    *out = resolve(alloc).get_pool_use_count(device, to_pool_id(id));
  });
}

ccalloc_status_t ccalloc_begin_allocate_to_pool(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id,
                                                ccalloc_stream_t stream, int all_streams) {
  return guarded([&] {
    ccalloc::caching_allocator& a = resolve(alloc);
    ccalloc::stream_filter filter;
    if (all_streams != 0) {
      filter = [](ccalloc::stream_t) { return true; };
    } else {
      // The allocator sees resolved streams: cudaStreamPerThread is this
      // thread's stream (a bad device is reported by begin_allocate_to_pool).
      ccalloc::stream_t only = to_stream(stream);
      if (device >= 0 && device < a.backend().device_count()) only = a.backend().resolve_stream(device, only);
      filter = [only](ccalloc::stream_t s) { return s == only; };
    }
    a.begin_allocate_to_pool(device, to_pool_id(id), std::move(filter));
  });
}

ccalloc_status_t ccalloc_begin_allocate_to_pool_filter(ccalloc_allocator_t* alloc, int device,
                                                       ccalloc_mempool_id_t id, ccalloc_stream_filter_fn filter,
                                                       void* user_data, ccalloc_user_data_release_fn release) {
  // Owns user_data: releases it once, when the last copy of the filter goes.
  std::shared_ptr<void> owned(user_data, [release](void* p) {
    if (release != nullptr) release(p);
  });
  return guarded([&] {
    require(reinterpret_cast<const void*>(filter), "ccalloc_begin_allocate_to_pool_filter", "filter");
    ccalloc::stream_filter wrapped = [filter, owned](ccalloc::stream_t s) {
      // The allocator asks with resolved streams, on the allocating thread: a
      // per-thread default stream is that thread's cudaStreamPerThread, the
      // handle the caller's filter can pass to CUDA (the resolved value is not
      // a cudaStream_t).
      if (ccalloc::device_backend::is_per_thread_stream(s)) s = ccalloc::per_thread_stream_handle;
      return filter(owned.get(), from_stream(s)) != 0;
    };
    resolve(alloc).begin_allocate_to_pool(device, to_pool_id(id), std::move(wrapped));
  });
}

ccalloc_status_t ccalloc_create_pool_with_source(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id,
                                                 ccalloc_segment_malloc_ud_fn malloc_fn,
                                                 ccalloc_segment_free_ud_fn free_fn, void* user_data) {
  return guarded([&] {
    require(reinterpret_cast<const void*>(malloc_fn), "ccalloc_create_pool_with_source", "malloc_fn");
    require(reinterpret_cast<const void*>(free_fn), "ccalloc_create_pool_with_source", "free_fn");
    caching_allocator& a = resolve(alloc);
    const ccalloc::mempool_id_t pool = to_pool_id(id);
    ccalloc::segment_allocator custom = wrap_segment_allocator(
        a.backend(), device, pool,
        [malloc_fn, user_data](void** ptr, std::size_t size) { return malloc_fn(user_data, ptr, size); },
        [free_fn, user_data](void* ptr) { return free_fn(user_data, ptr); });
    custom_segment_pools.store(true, std::memory_order_relaxed);
    a.create_or_incref_pool(device, pool, std::move(custom));
  });
}

ccalloc_status_t ccalloc_set_use_on_oom(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id,
                                        int enabled) {
  return guarded([&] { resolve(alloc).set_use_on_oom(device, to_pool_id(id), enabled != 0); });
}

ccalloc_status_t ccalloc_set_no_split(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id, int enabled) {
  return guarded([&] { resolve(alloc).set_no_split(device, to_pool_id(id), enabled != 0); });
}

ccalloc_status_t ccalloc_check_pool_live_allocations(ccalloc_allocator_t* alloc, int device,
                                                     ccalloc_mempool_id_t id, void* const* ptrs, size_t count,
                                                     int* out) {
  return guarded([&] {
    require(out, "ccalloc_check_pool_live_allocations", "out");
    if (count > 0) require(ptrs, "ccalloc_check_pool_live_allocations", "ptrs (with count > 0)");
    const std::vector<void*> expected(ptrs, ptrs + count);
    *out = resolve(alloc).check_pool_live_allocations(device, to_pool_id(id), expected) ? 1 : 0;
  });
}

ccalloc_status_t ccalloc_get_checkpoint_state(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id,
                                              ccalloc_pool_checkpoint_t** out) {
  return guarded([&] {
    require(out, "ccalloc_get_checkpoint_state", "out");
    auto checkpoint = std::make_unique<ccalloc_pool_checkpoint>();
    checkpoint->state = resolve(alloc).get_checkpoint_state(device, to_pool_id(id));
    *out = checkpoint.release();
  });
}

void ccalloc_pool_checkpoint_destroy(ccalloc_pool_checkpoint_t* checkpoint) { delete checkpoint; }

ccalloc_status_t ccalloc_set_checkpoint_pool_state(ccalloc_allocator_t* alloc, int device,
                                                   const ccalloc_pool_checkpoint_t* checkpoint,
                                                   ccalloc_checkpoint_block_fn on_block, void* user_data) {
  return guarded([&] {
    require(checkpoint, "ccalloc_set_checkpoint_pool_state", "checkpoint");
    caching_allocator& a = resolve(alloc);
    const ccalloc::checkpoint_restore_result result = a.set_checkpoint_pool_state(device, checkpoint->state);
    if (on_block == nullptr) return;
    for (void* ptr : result.freed_pointers) on_block(user_data, ptr, 0, 0);
    for (const ccalloc::allocation& created : result.blocks_created)
      on_block(user_data, created.ptr, a.device_allocator(device).block_size(created.block), 1);
  });
}

ccalloc_status_t ccalloc_enable_peer_access(ccalloc_allocator_t* alloc, int device, int peer) {
  return guarded([&] { resolve(alloc).enable_peer_access(device, peer); });
}

ccalloc_status_t ccalloc_end_allocate_to_pool(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id) {
  return guarded([&] { resolve(alloc).end_allocate_to_pool(device, to_pool_id(id)); });
}

ccalloc_status_t ccalloc_pool_usage(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id,
                                    ccalloc_pool_usage_t* out) {
  return guarded([&] {
    require(out, "ccalloc_pool_usage", "out");
    const ccalloc::pool_usage u = resolve(alloc).get_pool_stats(device, to_pool_id(id));
    *out = ccalloc_pool_usage_t{u.segment_count,    u.reserved_bytes,   u.allocated_bytes,
                                u.active_bytes,     u.allocation_count, u.use_count};
  });
}

namespace {
// The mapped ranges of one segment: the whole of a plain one, each run of
// mapped blocks of an expandable one.
void add_mapped_ranges(const ccalloc::segment_info& si, std::vector<ccalloc_mapped_segment_t>& out) {
  bool open = false;
  for (const ccalloc::block_info& b : si.blocks) {
    if (si.is_expandable && !b.mapped) {
      open = false;
      continue;
    }
    if (!open) {
      ccalloc_mapped_segment_t r{};
      r.device = si.device;
      r.address = static_cast<uintptr_t>(b.address);
      r.stream = from_stream(si.stream);
      r.is_large = si.is_small_pool ? 0 : 1;
      r.is_expandable = si.is_expandable ? 1 : 0;
      r.pool_id = ccalloc_mempool_id_t{si.pool.first, si.pool.second};
      out.push_back(r);
      open = true;
    }
    ccalloc_mapped_segment_t& r = out.back();
    r.total_bytes += b.size_bytes;
    if (b.state == ccalloc::block_state::active_allocated) r.allocated_bytes += b.size_bytes;
    if (b.state != ccalloc::block_state::inactive) {
      r.active_bytes += b.size_bytes;
      r.requested_bytes += b.requested_bytes;
    }
  }
}
}  // namespace

ccalloc_status_t ccalloc_mapped_segments(ccalloc_allocator_t* alloc, int device, ccalloc_mapped_segment_t* out,
                                         size_t* count) {
  return guarded([&] {
    require(count, "ccalloc_mapped_segments", "count");
    if (*count > 0) require(out, "ccalloc_mapped_segments", "out");
    ccalloc::caching_allocator& a = resolve(alloc);
    const int devices = a.initialized_device_count();
    if (devices == 0) throw ccalloc::invalid_argument_error("ccalloc: ccalloc_mapped_segments before ccalloc_init()");
    if (device < -1 || device >= devices)
      throw ccalloc::invalid_argument_error("ccalloc: ccalloc_mapped_segments: device " + std::to_string(device) +
                                            " is out of range (-1 for every device, or 0.." +
                                            std::to_string(devices - 1) + ")");
    std::vector<ccalloc_mapped_segment_t> ranges;
    for (int d = device < 0 ? 0 : device; d < (device < 0 ? devices : device + 1); ++d)
      for (const ccalloc::segment_info& si : a.device_allocator(d).segments())
        if (!si.paused) add_mapped_ranges(si, ranges);
    std::copy_n(ranges.begin(), std::min(*count, ranges.size()), out);
    *count = ranges.size();
  });
}

// ---- sleep and wake ---------------------------------------------------------------------------------------

namespace {
// The scopes ccalloc_tag_begin opened on this thread, innermost last.
thread_local std::vector<std::unique_ptr<ccalloc::tag_scope>> tls_tag_scopes;

std::vector<std::string> tag_list(const char* const* tags, size_t tag_count, const char* fn) {
  if (tag_count != 0) require(tags, fn, "tags");
  std::vector<std::string> out;
  for (size_t i = 0; i < tag_count; ++i) {
    if (tags[i] == nullptr)
      throw ccalloc::invalid_argument_error(std::string("ccalloc: ") + fn + ": tags[" + std::to_string(i) +
                                            "] is NULL");
    out.emplace_back(tags[i]);
  }
  return out;
}

void put_result(const ccalloc::sleep_result& r, ccalloc_sleep_result_t* out) {
  if (out != nullptr)
    *out = ccalloc_sleep_result_t{r.released_bytes, r.paused_bytes, r.copied_bytes, r.cache_released_bytes,
                                  r.host_time_us};
}
}  // namespace

ccalloc_status_t ccalloc_tag_begin(const char* tag) {
  return guarded([&] {
    require(tag, "ccalloc_tag_begin", "tag");
    tls_tag_scopes.reserve(tls_tag_scopes.size() + 1);  // no throw after the scope opens
    tls_tag_scopes.push_back(std::make_unique<ccalloc::tag_scope>(std::string_view(tag)));
  });
}

ccalloc_status_t ccalloc_tag_end(void) {
  return guarded([&] {
    if (tls_tag_scopes.empty())
      throw ccalloc::invalid_argument_error(
          "ccalloc: ccalloc_tag_end: no scope of ccalloc_tag_begin is open on this thread");
    tls_tag_scopes.pop_back();
  });
}

const char* ccalloc_current_tag(void) {
  // Interned names live in a deque that never moves them; one copy per id.
  static std::mutex mutex;
  static std::map<ccalloc::tag_id, std::unique_ptr<std::string>> names;
  const ccalloc::tag_id id = ccalloc::current_tag();
  std::lock_guard lock(mutex);
  auto& slot = names[id];
  if (!slot) slot = std::make_unique<std::string>(ccalloc::tag_name(id));
  return slot->c_str();
}

ccalloc_status_t ccalloc_pause(ccalloc_allocator_t* alloc, int device, const char* const* tags, size_t tag_count,
                               int keep_contents, ccalloc_sleep_result_t* out) {
  return guarded([&] {
    const std::vector<std::string> list = tag_list(tags, tag_count, "ccalloc_pause");
    put_result(resolve(alloc).pause(list, keep_contents != 0, device), out);
  });
}

ccalloc_status_t ccalloc_resume(ccalloc_allocator_t* alloc, int device, const char* const* tags, size_t tag_count,
                                ccalloc_sleep_result_t* out) {
  return guarded([&] {
    const std::vector<std::string> list = tag_list(tags, tag_count, "ccalloc_resume");
    put_result(resolve(alloc).resume(list, device), out);
  });
}

ccalloc_status_t ccalloc_tag_usage(ccalloc_allocator_t* alloc, int device, const char* tag, ccalloc_tag_usage_t* out) {
  return guarded([&] {
    require(tag, "ccalloc_tag_usage", "tag");
    require(out, "ccalloc_tag_usage", "out");
    *out = ccalloc_tag_usage_t{};
    for (const ccalloc::tag_usage& u : resolve(alloc).tag_stats(device))
      if (u.tag == tag)
        *out = ccalloc_tag_usage_t{u.allocated_bytes, u.reserved_bytes, u.paused_bytes, u.kept_bytes,
                                   u.segments,        u.blocks,         u.paused ? 1 : 0};
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
  if (ccalloc_delete(nullptr, ptr) != CCALLOC_OK) std::fprintf(stderr, "%s\n", tls_last_error.c_str());
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
