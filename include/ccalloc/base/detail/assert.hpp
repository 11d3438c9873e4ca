// ccalloc/base/detail/assert.hpp: CCALLOC_ASSERT, the check of an internal
// invariant (a mistake in ccalloc itself, never bad input). Not part of the
// public API.
//
// Checks come in three tiers (docs/design.md, "Checks in three tiers"):
//  - caller input: always checked, reported by an exception naming what was
//    wrong (invalid_argument_error, config_error, ...);
//  - internal invariants: CCALLOC_ASSERT, in debug builds (no NDEBUG) or
//    when CCALLOC_ENABLE_ASSERTS is defined (CMake option
//    CCALLOC_ENABLE_ASSERTS); compiled out otherwise, condition not
//    evaluated. A failure prints the condition, file and line on stderr and
//    aborts: the allocator's state cannot be trusted any more;
//  - per-structure checks at state transitions: CCALLOC_ASSERT_EXPENSIVE
//    (a structure's check(): page_fences, page_table, recycle_budget, a
//    segment's blocks), costlier than an operation's own work: on in debug
//    builds (no NDEBUG) and with CCALLOC_ENABLE_EXPENSIVE_ASSERTS (CMake
//    option of that name; the sanitizer stage of scripts/test.sh turns it
//    on), compiled out otherwise (Release, RelWithDebInfo);
//  - whole-structure checks: device_caching_allocator::check_invariants,
//    run by the property test after every step; it composes the
//    per-structure checks.
#pragma once

#include <cstdio>
#include <cstdlib>

namespace ccalloc::detail {

[[noreturn]] inline void assert_failed(const char* condition, const char* file, int line) noexcept {
  std::fprintf(stderr, "ccalloc: internal invariant violated: %s (%s:%d)\n", condition, file, line);
  std::abort();
}

}  // namespace ccalloc::detail

#if !defined(NDEBUG) || defined(CCALLOC_ENABLE_ASSERTS)
#define CCALLOC_ASSERT(condition) \
  ((condition) ? static_cast<void>(0) : ::ccalloc::detail::assert_failed(#condition, __FILE__, __LINE__))
#else
// Not evaluated; sizeof keeps the names in it "used" (no unused-variable warnings).
#define CCALLOC_ASSERT(condition) static_cast<void>(sizeof(!(condition)))
#endif

#if !defined(NDEBUG) || defined(CCALLOC_ENABLE_EXPENSIVE_ASSERTS)
#define CCALLOC_EXPENSIVE_ASSERTS_ON 1
#define CCALLOC_ASSERT_EXPENSIVE(condition) \
  ((condition) ? static_cast<void>(0) : ::ccalloc::detail::assert_failed(#condition, __FILE__, __LINE__))
#else
#define CCALLOC_EXPENSIVE_ASSERTS_ON 0
#define CCALLOC_ASSERT_EXPENSIVE(condition) static_cast<void>(sizeof(!(condition)))
#endif
