// ccalloc/base/detail/forced_unwind.hpp: forced_unwind, the exception type
// that ends a thread by unwinding its stack (pthread_exit, pthread_cancel on
// glibc: abi::__forced_unwind). Not part of the public API.
//
// A user callback (context recorder, trace tracker, out-of-memory observer)
// may end its thread: CPython does so to a daemon thread that asks for the
// interpreter's lock while the interpreter finalizes. Such an unwind must
// pass every frame up to the thread's start: a catch (...) that does not
// rethrow it aborts the process ("FATAL: exception not rethrown"), and so
// does a noexcept frame (std::terminate). The catch sites on a callback's way
// out therefore catch forced_unwind first and rethrow it.
#pragma once

#include <version>  // defines __GLIBCXX__ with libstdc++

#if defined(__GLIBCXX__)
#include <cxxabi.h>
#endif

namespace ccalloc::detail {

#if defined(__GLIBCXX__)
using forced_unwind = abi::__forced_unwind;
#else
/// No forced unwinding outside libstdc++: a type nothing throws.
struct forced_unwind {};
#endif

}  // namespace ccalloc::detail
