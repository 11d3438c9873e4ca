// The process-wide fork handlers and the lists of what they lock
// (ccalloc/base/detail/fork_handlers.hpp).
#include <ccalloc/base/detail/fork_handlers.hpp>

#include <ccalloc/base/detail/spin_mutex.hpp>

#include <pthread.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <mutex>
#include <new>
#include <vector>

namespace ccalloc::detail {
namespace {

struct rank_list {
  std::mutex mutex;                     // held from prepare to release
  std::vector<fork_registration*> members;  // in registration order [mutex]
  std::vector<fork_hooks> hooks;            // members' hooks, same order [mutex]
};

struct fork_state {
  std::array<rank_list, fork_rank_count> ranks;
  std::atomic<std::uint64_t> prepared{0};
};

// Never destroyed: a fork may come after static destructors have run.
fork_state& state() {
  static fork_state* s = new fork_state;
  return *s;
}

// Whether this thread's fork skipped the locks (it holds some itself).
constinit thread_local bool tls_fork_skipped = false;

void prepare() noexcept {
  tls_fork_skipped = tls_mapping_listener_depth != 0 || tls_world_locks_held != 0;
  if (tls_fork_skipped) return;
  fork_state& s = state();
  for (rank_list& r : s.ranks) {
    r.mutex.lock();
    for (const fork_hooks& h : r.hooks) h.prepare(h.self);
  }
  s.prepared.fetch_add(1, std::memory_order_relaxed);
}

void release(bool in_child) noexcept {
  if (tls_fork_skipped) return;
  fork_state& s = state();
  for (auto r = s.ranks.rbegin(); r != s.ranks.rend(); ++r) {
    for (auto h = r->hooks.rbegin(); h != r->hooks.rend(); ++h) h->release(h->self, in_child);
    r->mutex.unlock();
  }
}

void install_once() {
  static const bool installed = [] {
    if (pthread_atfork(prepare, [] { release(false); }, [] { release(true); }) != 0) throw std::bad_alloc();
    return true;
  }();
  (void)installed;
}

}  // namespace

fork_registration::fork_registration(fork_rank rank, fork_hooks hooks) : rank_(rank), hooks_(hooks) {
  install_once();
  rank_list& r = state().ranks[static_cast<std::size_t>(rank_)];
  std::lock_guard lock(r.mutex);
  r.members.push_back(this);
  try {
    r.hooks.push_back(hooks_);
  } catch (...) {
    r.members.pop_back();
    throw;
  }
  listed_ = true;
}

void fork_registration::cancel() noexcept {
  if (!listed_) return;
  rank_list& r = state().ranks[static_cast<std::size_t>(rank_)];
  std::lock_guard lock(r.mutex);
  const auto at = std::find(r.members.begin(), r.members.end(), this);
  r.hooks.erase(r.hooks.begin() + (at - r.members.begin()));
  r.members.erase(at);
  listed_ = false;
}

std::uint64_t fork_prepared_count() noexcept { return state().prepared.load(std::memory_order_relaxed); }

}  // namespace ccalloc::detail
