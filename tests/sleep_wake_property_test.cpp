// The sleep-and-wake property (tests/sleep_wake_property.hpp) in the
// concurrent test program, for ThreadSanitizer (scripts/test.sh's tsan
// stage builds and runs only this program). Other builds run the property
// once, from tests/property_test.cpp.
#include "sleep_wake_property.hpp"

#include <gtest/gtest.h>

#if defined(__has_feature)
#if __has_feature(thread_sanitizer)  // clang's spelling
#define CCALLOC_TEST_TSAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)  // GCC's
#define CCALLOC_TEST_TSAN 1
#endif

namespace {

TEST(SleepWakeProperty, TaggedOperationsPausesAndResumesFromSeveralThreadsKeepEveryInvariant) {
#if defined(CCALLOC_TEST_TSAN)
  ccalloc_test::sleep_wake_property::check_tagged_pauses_and_resumes_from_several_threads();
#else
  GTEST_SKIP() << "runs under ThreadSanitizer only; other builds run it as "
                  "Property.TaggedScopesPausesAndResumesFromSeveralThreads (tests/property_test.cpp)";
#endif
}

}  // namespace
