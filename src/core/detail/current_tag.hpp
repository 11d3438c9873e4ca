// The calling thread's tag (tags.hpp): one thread-local that malloc reads on
// every call (a non-default tag takes the routed path, hot_path.cpp).
#pragma once

#include <ccalloc/base/detail/hot_tls.hpp>
#include <ccalloc/core/tags.hpp>

namespace ccalloc::detail {

CCALLOC_HOT_TLS inline thread_local tag_id tls_current_tag = default_tag_id;

}  // namespace ccalloc::detail
