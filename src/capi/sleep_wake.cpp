// The C API: tags, sleep (pause) and wake (resume).
#include "capi.hpp"

#include <ccalloc/base/detail/fork_handlers.hpp>
#include <ccalloc/base/detail/thread_object.hpp>
#include <ccalloc/core/tags.hpp>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

using namespace ccalloc::capi_detail;  // NOLINT(google-build-using-namespace)

extern "C" {

// ---- sleep and wake ---------------------------------------------------------------------------------------

namespace {
// The scopes ccalloc_tag_begin opened on this thread, innermost last (not a
// C++ thread_local: base/detail/thread_object.hpp).
using tag_scopes = std::vector<std::unique_ptr<ccalloc::tag_scope>>;
using tag_scopes_of = ccalloc::detail::thread_object<tag_scopes>;

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
    tag_scopes& scopes = tag_scopes_of::get();
    scopes.reserve(scopes.size() + 1);  // no throw after the scope opens
    scopes.push_back(std::make_unique<ccalloc::tag_scope>(std::string_view(tag)));
  });
}

ccalloc_status_t ccalloc_tag_end(void) {
  return guarded([&] {
    tag_scopes* scopes = tag_scopes_of::find();
    if (scopes == nullptr || scopes->empty())
      throw ccalloc::invalid_argument_error(
          "ccalloc: ccalloc_tag_end: no scope of ccalloc_tag_begin is open on this thread");
    scopes->pop_back();
  });
}

const char* ccalloc_current_tag(void) {
  // Interned names live in a deque that never moves them; one copy per id.
  struct name_copies {
    std::mutex mutex;
    std::map<ccalloc::tag_id, std::unique_ptr<std::string>> names;
    // Around a fork (base/detail/fork_handlers.hpp): a leaf lock.
    ccalloc::detail::fork_registration fork{
        ccalloc::detail::fork_rank::leaf,
        ccalloc::detail::fork_hooks{this, [](void* self) noexcept { static_cast<name_copies*>(self)->mutex.lock(); },
                                    [](void* self, bool) noexcept {
                                      static_cast<name_copies*>(self)->mutex.unlock();
                                    }}};
  };
  static name_copies copies;
  const ccalloc::tag_id id = ccalloc::current_tag();
  std::lock_guard lock(copies.mutex);
  auto& slot = copies.names[id];
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
    // A bad name is INVALID_ARGUMENT, as for ccalloc_tag_begin: intern_tag
    // throws naming the rule it breaks (and interns nothing).
    if (!ccalloc::is_tag_name(tag)) (void)ccalloc::intern_tag(tag);
    *out = ccalloc_tag_usage_t{};
    for (const ccalloc::tag_usage& u : resolve(alloc).tag_stats(device))
      if (u.tag == tag)
        *out = ccalloc_tag_usage_t{u.allocated_bytes, u.reserved_bytes, u.paused_bytes, u.kept_bytes,
                                   u.segments,        u.blocks,         u.paused ? 1 : 0};
  });
}

}  // extern "C"
