// Tags (SPEC S1): the process-wide table of tag names and the per-thread
// scope. Names are interned once and never removed, so an id stays valid for
// the life of the process and every device agrees on it.
#include <ccalloc/core/tags.hpp>

#include <ccalloc/base/detail/fork_handlers.hpp>
#include <ccalloc/base/errors.hpp>

#include "detail/current_tag.hpp"

#include <deque>
#include <mutex>
#include <new>
#include <shared_mutex>
#include <string>
#include <unordered_map>

namespace ccalloc {
namespace {

struct tag_table {
  std::shared_mutex mutex;
  std::deque<std::string> names{std::string(default_tag_name)};  // by id; stable addresses
  std::unordered_map<std::string_view, tag_id> ids{{default_tag_name, default_tag_id}};
  // Around a fork (base/detail/fork_handlers.hpp): a leaf lock. The child
  // makes it anew instead of unlocking it: glibc's read-write lock knows
  // its writer by thread id, which the child's thread does not share with
  // the parent's, so an unlock there would count as a reader's.
  detail::fork_registration fork{detail::fork_rank::leaf,
                                 detail::fork_hooks{this,
                                                    [](void* self) noexcept {
                                                      static_cast<tag_table*>(self)->mutex.lock();
                                                    },
                                                    [](void* self, bool in_child) noexcept {
                                                      std::shared_mutex& m = static_cast<tag_table*>(self)->mutex;
                                                      if (in_child) ::new (static_cast<void*>(&m)) std::shared_mutex;
                                                      else m.unlock();
                                                    }}};
};

tag_table& table() {
  static tag_table t;  // never destroyed before a thread's last scope: a function-local static
  return t;
}

bool allowed(char c) noexcept {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
         c == '.' || c == ':' || c == '/';
}

void check_name(std::string_view name) {
  if (name.empty()) throw invalid_argument_error("ccalloc: tag name is empty; give 1 to 64 characters");
  if (name.size() > max_tag_name_bytes)
    throw invalid_argument_error("ccalloc: tag name '" + std::string(name.substr(0, 16)) + "...' is " +
                                 std::to_string(name.size()) + " bytes long; the limit is " +
                                 std::to_string(max_tag_name_bytes));
  for (char c : name)
    if (!allowed(c))
      throw invalid_argument_error("ccalloc: tag name '" + std::string(name) +
                                   "' has a character outside letters, digits and _-.:/ (byte " +
                                   std::to_string(static_cast<unsigned char>(c)) + ")");
}

}  // namespace

tag_id intern_tag(std::string_view name) {
  check_name(name);
  tag_table& t = table();
  {
    std::shared_lock lock(t.mutex);
    if (auto it = t.ids.find(name); it != t.ids.end()) return it->second;
  }
  std::unique_lock lock(t.mutex);
  if (auto it = t.ids.find(name); it != t.ids.end()) return it->second;
  const auto id = static_cast<tag_id>(t.names.size());
  t.names.emplace_back(name);
  t.ids.emplace(t.names.back(), id);
  return id;
}

std::optional<tag_id> find_tag(std::string_view name) noexcept {
  tag_table& t = table();
  std::shared_lock lock(t.mutex);
  if (auto it = t.ids.find(name); it != t.ids.end()) return it->second;
  return std::nullopt;
}

std::string tag_name(tag_id id) {
  tag_table& t = table();
  std::shared_lock lock(t.mutex);
  if (id >= t.names.size())
    throw invalid_argument_error("ccalloc: tag id " + std::to_string(id) + " was never handed out");
  return t.names[id];
}

tag_id current_tag() noexcept { return detail::tls_current_tag; }

tag_scope::tag_scope(std::string_view name) : id_(intern_tag(name)), previous_(detail::tls_current_tag) {
  detail::tls_current_tag = id_;
}

tag_scope::tag_scope(tag_id id) noexcept : id_(id), previous_(detail::tls_current_tag) {
  detail::tls_current_tag = id_;
}

tag_scope::~tag_scope() { detail::tls_current_tag = previous_; }

}  // namespace ccalloc
