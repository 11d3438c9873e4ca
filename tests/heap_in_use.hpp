// heap_in_use.hpp: the host heap's bytes in use, for tests that something
// repeated for ever (a stream or a tag per request) keeps the heap flat.
// Defines CCALLOC_TEST_ASAN under AddressSanitizer (GCC or Clang).
#pragma once

#include <cstddef>

#if defined(__SANITIZE_ADDRESS__)
#define CCALLOC_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CCALLOC_TEST_ASAN 1
#endif
#endif

#ifdef CCALLOC_TEST_ASAN
// The sanitizer runtime's count of live heap bytes (declared here: GCC does
// not ship <sanitizer/allocator_interface.h>; its libasan has the function).
extern "C" std::size_t __sanitizer_get_current_allocated_bytes();
#else
#include <malloc.h>
#endif

namespace ccalloc::testing {

#ifdef CCALLOC_TEST_ASAN
inline std::size_t heap_bytes_in_use() { return __sanitizer_get_current_allocated_bytes(); }
#else
// The heap's bytes in use (the main arena's, and blocks mmapped on their
// own): a single-threaded loop allocates only there.
inline std::size_t heap_bytes_in_use() {
  const struct mallinfo2 m = mallinfo2();
  return m.uordblks + m.hblkhd;
}
#endif

}  // namespace ccalloc::testing
