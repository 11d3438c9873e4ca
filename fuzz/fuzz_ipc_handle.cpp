// libFuzzer target for the IPC handle parser (SPEC R3, F25).
//
// Properties checked on every input: parse_ipc_handle either throws
// invalid_argument_error or returns a handle; a returned handle encodes back
// to exactly the input bytes (the format has one encoding per handle) and
// parses again to an equal handle. Any other exception, crash or sanitizer
// report is a bug.
#include <ccalloc/base/errors.hpp>
#include <ccalloc/frontend/ipc_handle.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

namespace {

int check_one(std::string_view bytes) {
  ccalloc::ipc_handle h;
  try {
    h = ccalloc::parse_ipc_handle(bytes);
  } catch (const ccalloc::invalid_argument_error&) {
    return 0;
  }
  const std::string again = ccalloc::encode_ipc_handle(h);
  if (again != bytes) std::abort();
  if (!(ccalloc::parse_ipc_handle(again) == h)) std::abort();
  if (h.kind == ccalloc::ipc_kind::expandable && h.fd_count() > h.pages.size() + (h.has_lease() ? 1 : 0))
    std::abort();
  return 0;
}

}  // namespace

// Each input is parsed as it is, and, when it is long enough to hold a
// checksum, once more with its checksum (bytes 20..23) made to match: a
// mutated version 3 handle otherwise stops at the checksum, and the field
// rules behind it would go untested.
extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  check_one(bytes);
  if (size < 24) return 0;
  std::string fixed(bytes);
  const std::uint32_t sum = ccalloc::ipc_handle_checksum(fixed);
  for (int i = 0; i < 4; ++i) fixed[20 + i] = static_cast<char>((sum >> (8 * i)) & 0xff);
  if (fixed != bytes) check_one(fixed);
  return 0;
}
