// The C API: tags, sleep (pause) and wake (resume).
#include "capi.hpp"

#include <ccalloc/base/detail/fork_handlers.hpp>
#include <ccalloc/base/detail/thread_object.hpp>
#include <ccalloc/base/printable_text.hpp>
#include <ccalloc/core/tags.hpp>

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

using namespace ccalloc::capi_detail;  // NOLINT(google-build-using-namespace)

extern "C" {

// ---- sleep and wake ---------------------------------------------------------------------------------------

namespace {
// One scope ccalloc_tag_begin opened: its tag, the thread's tag just before
// it opened, and the open tag_scope. The optional lets ccalloc_tag_end_named
// close and reopen it in place (no allocation, nothing that throws).
struct c_tag_scope {
  ccalloc::tag_id id = ccalloc::default_tag_id;
  ccalloc::tag_id previous = ccalloc::default_tag_id;
  std::optional<ccalloc::tag_scope> scope;
};
// The scopes ccalloc_tag_begin opened on this thread, innermost last (not a
// C++ thread_local: base/detail/thread_object.hpp).
using tag_scopes = std::vector<std::unique_ptr<c_tag_scope>>;
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
    const ccalloc::tag_id id = ccalloc::intern_tag(tag);
    auto entry = std::make_unique<c_tag_scope>();
    entry->id = id;
    entry->previous = ccalloc::current_tag();
    entry->scope.emplace(id);
    scopes.push_back(std::move(entry));
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

ccalloc_status_t ccalloc_tag_end_named(const char* tag) {
  return guarded([&] {
    require(tag, "ccalloc_tag_end_named", "tag");
    tag_scopes* scopes = tag_scopes_of::find();
    const std::optional<ccalloc::tag_id> id = ccalloc::find_tag(tag);
    std::size_t closing = scopes == nullptr || !id ? 0 : scopes->size();
    while (closing > 0 && (*scopes)[closing - 1]->id != *id) --closing;
    if (closing == 0)
      throw ccalloc::invalid_argument_error(std::string("ccalloc: ccalloc_tag_end_named: no scope of tag '") +
                                            ccalloc::printable_line(tag) +
                                            "' that ccalloc_tag_begin opened is open on this thread");
    --closing;  // its index
    // The scopes above it reopen on top of the tag it had replaced; each
    // must have opened right on the one below it (no C++ tag_scope opened
    // since is still open), or reopening would lose that tag_scope's tag.
    tag_scopes& s = *scopes;
    bool chained = ccalloc::current_tag() == s.back()->id;
    for (std::size_t i = closing + 1; i < s.size(); ++i) chained = chained && s[i]->previous == s[i - 1]->id;
    if (!chained)
      throw ccalloc::invalid_argument_error(std::string("ccalloc: ccalloc_tag_end_named: a C++ tag_scope opened "
                                                        "after the scope of tag '") +
                                            tag + "' is still open on this thread");
    // Close the scopes from the innermost down to it, then reopen those
    // above it: the thread's tag is restored as tag_scope's destructors go.
    for (std::size_t i = s.size(); i-- > closing;) s[i]->scope.reset();
    for (std::size_t i = closing + 1; i < s.size(); ++i) {
      s[i]->previous = i == closing + 1 ? s[closing]->previous : s[i - 1]->id;
      s[i]->scope.emplace(s[i]->id);
    }
    s.erase(s.begin() + static_cast<std::ptrdiff_t>(closing));
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
