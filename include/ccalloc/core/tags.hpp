// ccalloc/core/tags.hpp: tags, the names under which memory sleeps and wakes
// (SPEC S1-S5).
//
// Every allocation carries a tag: the tag in scope on the calling thread when
// it was made ("default" when none is). A tag_scope sets it for the
// allocations of its thread until it ends (scopes nest; the inner one wins).
// Blocks of two tags never share a page: each named tag's memory lives in its
// own reservations (expandable segments, whatever expandable_segments says,
// where the backend has virtual memory), so a tag's pages can be released
// (pause) and mapped again at the same addresses (resume) without touching
// another tag's memory. "default" is the allocator's ordinary pools; it is
// never paused.
//
// A private pool (F20-F24, a CUDA graph's pool) takes the tag in scope when
// it is created (create_or_incref_pool): its memory pauses and resumes with
// that tag, whatever tag is in scope when a routed allocation is made.
//
// A tag that holds nothing on a device (no block, cached page or segment
// there; a paused one stays paused) costs that device nothing: its pool and
// its reservation are given back when its last segment goes (page
// recycling moves a freed tag's cached page to the next request, the
// ladder's retries and empty_cache give cached memory back), so a tag per
// request or per job does not make the process grow. Using the name again
// makes a fresh tag there, with the same name and id.
//
// Names: 1 to max_tag_name_bytes bytes of ASCII letters, digits and "_-.:/";
// interned once per process (ids are never reused; each distinct name keeps
// about 100 bytes of host memory for the life of the process: history
// entries and snapshots name tags by id). Thread safety: every function here
// may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ccalloc {

/// A tag's process-wide id; default_tag_id is "default".
using tag_id = std::uint32_t;
inline constexpr tag_id default_tag_id = 0;
inline constexpr std::string_view default_tag_name = "default";
inline constexpr std::size_t max_tag_name_bytes = 64;

/// Whether `name` follows the rule above, without interning it (intern_tag
/// throws for exactly the names this refuses, naming the rule broken).
[[nodiscard]] constexpr bool is_tag_name(std::string_view name) noexcept {
  if (name.empty() || name.size() > max_tag_name_bytes) return false;
  for (const char c : name) {
    const bool allowed = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                         std::string_view("_-.:/").find(c) != std::string_view::npos;
    if (!allowed) return false;
  }
  return true;
}

/// The id of `name`, interned on first use. Throws invalid_argument_error
/// naming the name and the rule it breaks (empty, longer than
/// max_tag_name_bytes, a character outside the set above).
[[nodiscard]] tag_id intern_tag(std::string_view name);
/// The id of `name` if it was ever interned, else nullopt (no error).
[[nodiscard]] std::optional<tag_id> find_tag(std::string_view name) noexcept;
/// The name of `id`; throws invalid_argument_error for an id never handed out.
[[nodiscard]] std::string tag_name(tag_id id);

/// The calling thread's tag (default_tag_id outside every scope).
[[nodiscard]] tag_id current_tag() noexcept;

/// Sets the calling thread's tag from construction to destruction and then
/// puts back the one before (C++ RAII; the C API's ccalloc_tag_begin/end and
/// Python's `with ccalloc.tag(name)` are the same scope). Throws what
/// intern_tag throws (then nothing changed). Not movable: a scope belongs to
/// its thread.
class tag_scope {
 public:
  explicit tag_scope(std::string_view name);
  explicit tag_scope(tag_id id) noexcept;
  ~tag_scope();
  tag_scope(const tag_scope&) = delete;
  tag_scope& operator=(const tag_scope&) = delete;
  [[nodiscard]] tag_id id() const noexcept { return id_; }

 private:
  tag_id id_;
  tag_id previous_;
};

/// One tag's memory on one device (device_caching_allocator::tag_stats).
/// Bytes: allocated = blocks handed out under the tag (paused ones included:
/// they still belong to their callers); reserved = device memory its
/// segments hold now (mapped pages; a paused tag holds none of its paused
/// pages); paused = bytes of pages released by pause that resume maps again
/// (the pages under its live blocks); kept = bytes of those held in pinned
/// host memory (keep_contents). For "default": the default pools'.
struct tag_usage {
  std::string tag;
  bool paused = false;
  std::size_t allocated_bytes = 0;
  std::size_t reserved_bytes = 0;
  std::size_t paused_bytes = 0;
  std::size_t kept_bytes = 0;
  std::size_t segments = 0;  ///< reservations (or segments) of the tag
  std::size_t blocks = 0;    ///< allocated blocks of the tag
};

/// What one pause or resume did (device_caching_allocator::pause, resume).
struct sleep_result {
  std::vector<std::string> tags;  ///< the tags it changed (already paused/active ones left out)
  std::size_t released_bytes = 0;  ///< pause: device bytes unmapped (paused pages + the tag's cached free pages)
  std::size_t paused_bytes = 0;    ///< pages under live blocks, unmapped by pause / mapped by resume
  std::size_t copied_bytes = 0;    ///< bytes copied to (pause) or from (resume) pinned host memory
  std::size_t cache_released_bytes = 0;  ///< resume: ccalloc's cached memory of active tags given back first
  std::uint64_t host_time_us = 0;  ///< the backend's host clock across the call (0 without one)
};

}  // namespace ccalloc
