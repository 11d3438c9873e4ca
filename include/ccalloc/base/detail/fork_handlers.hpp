// ccalloc/base/detail/fork_handlers.hpp: what fork() does with the
// allocator's locks. Not part of the public API.
//
// A child of fork() has one thread, the one that called fork(); every lock
// another thread of the parent held at that instant stays held in the child
// by a thread that does not exist there. So the process-wide fork handlers
// (pthread_atfork, installed by the first registration) take every lock of
// every live allocator before the fork and release them in the parent and
// in the child after it: the child's allocators start with every lock free
// and their data as the parent's threads last left it between two
// operations.
//
// The locks are taken in the lock order of the whole library, rank by rank
// (fork_rank), and within a rank in the order of registration (a front
// end's devices register in index order). Each rank's list has its own
// mutex, taken before the rank's locks and released after them, so that an
// object built or destroyed while a fork is under way waits for it, and is
// never half locked. Rule for the code: an object of rank R registers and
// unregisters holding no lock of rank R or after (it may hold earlier ones:
// a front end makes its devices holding its configuration lock).
//
// A fork from a thread that holds allocator locks itself (a callback the
// allocator runs under a device's world lock: a mapping listener, a private
// pool's segment allocator, a snapshot's frames callback) cannot take them
// in order: the handlers then take nothing, and the child is what fork()
// makes without them (safe only if no other thread was inside an
// allocator). tls_world_locks_held and tls_mapping_listener_depth tell.
#pragma once

#include <cstdint>

namespace ccalloc::detail {

// The world locks (every lock of a device) this thread holds; counted by
// world_lock on the slow path only.
inline thread_local int tls_world_locks_held = 0;

// In the library's lock order: a rank's locks are taken after those of
// every earlier rank.
enum class fork_rank : std::uint8_t {
  // A front end's configuration lock, its IPC exports and imports (each
  // held while calling into its devices or the backend).
  front_end,
  // A device's world lock: its stream registry, every stream, the device,
  // the statistics (detail/device_state.hpp, "Locking").
  device,
  // A device's locks taken under its world lock: its thread caches (the
  // core, then each record), capture scopes, history, mapping listener list.
  device_inner,
  // Locks held while taking no other lock: the tag table, a front end's
  // pointer map shards.
  leaf,
  // A device backend's own locks (taken under every lock above).
  backend,
};
inline constexpr int fork_rank_count = 5;

// Takes and releases one object's locks around a fork. prepare() takes them
// (in the lock order); release() frees them, in the parent (in_child false)
// and in the child (in_child true), where the holder is the only thread.
struct fork_hooks {
  void* self = nullptr;
  void (*prepare)(void* self) noexcept = nullptr;
  void (*release)(void* self, bool in_child) noexcept = nullptr;
};

// Lists `hooks` for every later fork until cancel() or destruction. The
// constructor installs the handlers the first time (pthread_atfork), and
// throws std::bad_alloc when the host is out of memory. Not copyable or
// movable (the list refers to it).
class fork_registration {
 public:
  fork_registration(fork_rank rank, fork_hooks hooks);
  ~fork_registration() { cancel(); }
  fork_registration(const fork_registration&) = delete;
  fork_registration& operator=(const fork_registration&) = delete;
  // Leaves the list (waits for a fork under way); idempotent. An owner
  // calls it first in its destructor, before it tears down what its hooks
  // lock.
  void cancel() noexcept;

 private:
  fork_rank rank_;
  fork_hooks hooks_;
  bool listed_ = false;
};

// The number of forks whose handlers took every lock (this process and its
// parents before their forks); for tests.
[[nodiscard]] std::uint64_t fork_prepared_count() noexcept;

}  // namespace ccalloc::detail
