// The C API: errors (the thread-local last message, status names) and identity.
#include "capi.hpp"

#include <ccalloc/backend/default_backend.hpp>
#include <ccalloc/base/detail/thread_object.hpp>

#ifndef CCALLOC_VERSION_STRING  // set by CMake (project version)
#define CCALLOC_VERSION_STRING "unknown"
#endif

#include <string>
#include <string_view>

namespace ccalloc::capi_detail {

namespace {
// The thread's last message (not a C++ thread_local: a thread's first error
// must not stop the process when the host's memory is exhausted,
// base/detail/thread_object.hpp); and a fixed message instead, when the
// last one could not be stored.
using last_error_of = ccalloc::detail::thread_object<std::string>;
constinit thread_local const char* tls_fixed_error = nullptr;
}  // namespace

void set_last_error(std::string_view head, std::string_view tail, bool c_api) noexcept {
  try {
    std::string text;
    text.reserve(head.size() + tail.size());
    text.append(head).append(tail);
    text = c_api ? c_api_message(std::move(text)) : with_prefix(std::move(text));
    last_error_of::get() = std::move(text);
    tls_fixed_error = nullptr;
  } catch (...) {  // std::bad_alloc
    tls_fixed_error = "ccalloc: out of host memory inside the library (this error's own message could not be stored)";
  }
}

const char* last_error_text() noexcept {
  if (tls_fixed_error != nullptr) return tls_fixed_error;
  const std::string* text = last_error_of::find();
  return text != nullptr ? text->c_str() : "";
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

/// Throws invalid_argument_error naming `function` and `what` (a NULL argument).
[[gnu::noinline, gnu::cold, noreturn]] void throw_null(const char* function, const char* what) {
  throw ccalloc::invalid_argument_error(std::string("ccalloc: ") + function + ": " + what + " is NULL");
}

}  // namespace ccalloc::capi_detail

using namespace ccalloc::capi_detail;  // NOLINT(google-build-using-namespace)

extern "C" {

// ---- errors and identity -----------------------------------------------------------

const char* ccalloc_last_error(void) { return last_error_text(); }

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

}  // extern "C"
