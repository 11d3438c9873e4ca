// ccalloc/base/detail/thread_object.hpp: thread_object<T>, one T per thread,
// made at the thread's first use and destroyed at its exit, without a C++
// thread_local destructor. Not part of the public API.
//
// Why: glibc records each C++ thread_local destructor at a thread's first
// use of the variable, in memory it allocates right then, and stops the
// process when that allocation fails ("Fatal glibc error: failed to
// register TLS destructor: out of memory"). A thread that first calls the
// library while the host's memory is exhausted would stop the process
// instead of getting an out-of-memory error. A thread_object's T is made
// with new and handed to a POSIX thread-specific key, whose destructor
// deletes it at the thread's exit: setting the key allocates nothing for
// the process's first 32 keys and reports ENOMEM otherwise, so every
// failure is a std::bad_alloc that the caller answers as any other.
//
// At a thread's exit, glibc runs the keys' destructors after the C++
// thread_local destructors: a thread_local object of the program whose
// destructor calls the library still finds the thread's T. exit() runs no
// key destructor for the thread that calls it (the main thread): its T is
// deleted by a static destructor instead, so that leak checkers see none.
// The key's destructor is code of the library: the shared library is
// linked with -z nodelete, so that dlclose() never unloads it under a
// thread that has yet to exit.
#pragma once

#include <memory>
#include <new>

#include <pthread.h>

namespace ccalloc::detail {

/// One T per thread (T default-constructible; its destructor must not
/// throw). Thread-safe: each thread sees only its own T.
template <class T>
class thread_object {
 public:
  /// The calling thread's T, made at its first call (and again after its
  /// destruction at the thread's exit, for a later call of a destructor).
  /// Throws std::bad_alloc when the host's memory is exhausted.
  static T& get() {
    if (T* p = tls_object_) [[likely]]
      return *p;
    return make();
  }

  /// The calling thread's T if made and not destroyed since, else null.
  [[nodiscard]] static T* find() noexcept { return tls_object_; }

 private:
  // Deletes the exiting thread's T (the pointer is cleared first: the
  // destructor of T sees find() == null).
  static void destroy(void* p) noexcept {
    tls_object_ = nullptr;
    delete static_cast<T*>(p);
  }

  // Deletes the T of the thread that runs the static destructors (exit()).
  struct reclaim_at_exit {
    reclaim_at_exit() = default;
    reclaim_at_exit(const reclaim_at_exit&) = delete;
    reclaim_at_exit& operator=(const reclaim_at_exit&) = delete;
    ~reclaim_at_exit() {
      if (T* p = tls_object_) {
        (void)pthread_setspecific(key(), nullptr);
        destroy(p);
      }
    }
  };

  static pthread_key_t key() {
    static const pthread_key_t k = [] {
      pthread_key_t made{};
      if (pthread_key_create(&made, &destroy) != 0) throw std::bad_alloc();
      return made;
    }();
    return k;
  }

  [[gnu::noinline]] static T& make() {
    static reclaim_at_exit reclaim;  // its destructor runs at exit()
    auto made = std::make_unique<T>();
    if (pthread_setspecific(key(), made.get()) != 0) throw std::bad_alloc();
    tls_object_ = made.get();
    return *made.release();
  }

  static constinit inline thread_local T* tls_object_ = nullptr;
};

}  // namespace ccalloc::detail
