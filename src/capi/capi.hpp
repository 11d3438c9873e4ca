// What the C API's files (src/capi/, one concern each) share: the handle
// types behind the C pointers, the exception-to-status guard, argument
// checks and conversions, and the record of a pool's failed segment malloc.
#pragma once

#include <ccalloc/ccalloc.h>

#include <ccalloc/base/detail/pointer_text.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <atomic>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <string_view>

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

namespace ccalloc::capi_detail {

using ccalloc::caching_allocator;

/// Stores `head` + `tail` as the calling thread's message, the one
/// ccalloc_last_error() returns (errors.cpp): with the prefix "ccalloc: "
/// (with_prefix), or, when `c_api`, as a C caller reads it (c_api_message).
/// Never throws: without host memory for the message, the thread's message
/// becomes a fixed one that says so.
void set_last_error(std::string_view head, std::string_view tail = {}, bool c_api = false) noexcept;
/// The calling thread's last message ("" before any); valid until its next
/// failing call.
[[nodiscard]] const char* last_error_text() noexcept;

/// `message` with the prefix every C API message has, "ccalloc: " (the
/// backends' own messages start "sim: " or "cuda: ").
inline std::string with_prefix(std::string message) {
  if (!message.starts_with("ccalloc")) message.insert(0, "ccalloc: ");
  return message;
}

/// A front-end message as a C caller reads it: the C++ calls it names
/// (init(), init(device_count)) become the C functions to call.
std::string c_api_message(std::string message);

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
    set_last_error(e.what());
    return CCALLOC_ERROR_OUT_OF_MEMORY;
  } catch (const ccalloc::config_error& e) {
    set_last_error(e.what());
    return CCALLOC_ERROR_CONFIG;
  } catch (const ccalloc::invalid_argument_error& e) {
    set_last_error(e.what(), {}, /*c_api=*/true);
    return CCALLOC_ERROR_INVALID_ARGUMENT;
  } catch (const ccalloc::backend_error& e) {
    set_last_error(e.what());
    return CCALLOC_ERROR_BACKEND;
  } catch (const std::bad_alloc&) {
    set_last_error("ccalloc: out of host memory inside the library");
    return CCALLOC_ERROR_INTERNAL;
  } catch (const std::exception& e) {
    set_last_error("ccalloc: internal error: ", e.what());
    return CCALLOC_ERROR_INTERNAL;
  } catch (...) {
    set_last_error("ccalloc: internal error: unknown exception");
    return CCALLOC_ERROR_INTERNAL;
  }
}

/// The front end behind a handle; NULL is the process-wide allocator.
inline caching_allocator& resolve(ccalloc_allocator_t* alloc) {
  return alloc == nullptr ? ccalloc::global_allocator() : *alloc->allocator;
}

/// Throws invalid_argument_error naming `function` and `what` (a NULL argument).
[[gnu::noinline, gnu::cold, noreturn]] void throw_null(const char* function, const char* what);

/// Throws invalid_argument_error naming `function` and `what` when `ptr` is
/// null. Inline: one test where ccalloc_malloc checks its `out`.
[[gnu::always_inline]] inline void require(const void* ptr, const char* function, const char* what) {
  if (ptr == nullptr) [[unlikely]]
    throw_null(function, what);
}

inline ccalloc::stream_t to_stream(ccalloc_stream_t stream) noexcept { return reinterpret_cast<ccalloc::stream_t>(stream); }
inline ccalloc_stream_t from_stream(ccalloc::stream_t stream) noexcept {
  return reinterpret_cast<ccalloc_stream_t>(stream);  // NOLINT(performance-no-int-to-ptr)
}

using ccalloc::detail::pointer_text;

inline ccalloc::mempool_id_t to_pool_id(ccalloc_mempool_id_t id) noexcept { return {id.first, id.second}; }

// ---- pools' segment allocators --------------------------------------------------------

/// True once any pool got a segment allocator: only then do allocations
/// track segment_failure (one relaxed load otherwise).
extern std::atomic<bool> custom_segment_pools;  // allocation.cpp

/// What a pool's segment malloc returned when it failed on this thread,
/// during the current allocation call: kept for the out-of-memory message.
struct segment_failure {
  bool set = false;
  int code = 0;
  int device = 0;
  ccalloc::mempool_id_t pool{};
};
extern thread_local segment_failure tls_segment_failure;  // allocation.cpp

}  // namespace ccalloc::capi_detail
