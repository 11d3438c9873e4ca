// backend_conformance.hpp: one conformance suite of the device_backend
// contract (include/ccalloc/backend/device_backend.hpp), run against every
// backend: the simulated device in CI (tests/backend_conformance_test.cpp, a
// parameterized GoogleTest suite) and the CUDA backend on a GPU
// (tests/gpu/gpu_tests.cpp, test "backend_conformance", label gpu: the GPU
// machine has no GoogleTest). So the two backends cannot drift apart.
//
// Each case checks one group of functions: what they return, the error
// convention (out of memory is a return value, everything else throws
// backend_error), and that capabilities() tells the truth (a capability that
// is off makes its functions throw "not supported"; one that is on makes them
// work). The suite reaches the device only through the contract plus the
// small fixture below (making a stream busy, reading and writing device
// memory), which each harness implements for its backend.
//
// Header-only and plain C++ (no GoogleTest, no CUDA): checks report through
// backend_fixture::fail and go on; a skipped check calls fixture.skip, which
// throws.
#pragma once

#include <ccalloc/backend/device_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/base/types.hpp>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <thread>
#include <vector>

namespace ccalloc::conformance {

/// What a harness provides for one backend. Device 0 is used throughout.
class backend_fixture {
 public:
  virtual ~backend_fixture() = default;
  [[nodiscard]] virtual device_backend& backend() = 0;
  /// Queues work on `stream` of device 0 that keeps it busy long enough for
  /// the next few calls to see it running (simulated device: virtual time far
  /// ahead; GPU: a spin kernel of a few hundred ms). `stream` may be a special
  /// handle: it means the stream it stands for on the calling thread.
  virtual void keep_busy(stream_t stream) = 0;
  /// Copies host bytes to device memory and returns when done.
  virtual void write(void* dst, const std::vector<unsigned char>& bytes) = 0;
  /// Copies `n` bytes of device memory to the host and returns them.
  [[nodiscard]] virtual std::vector<unsigned char> read(const void* src, std::size_t n) = 0;
  /// False where a device call must not fail on purpose (compute-sanitizer
  /// reports it): the checks of failing calls are skipped then.
  [[nodiscard]] virtual bool may_fail_calls() const { return true; }
  /// False where keep_busy's work may already be over when checked (a slow
  /// run under a sanitizer): "not complete yet" is then not checked.
  [[nodiscard]] virtual bool busy_is_observable() const { return true; }
  /// Records a failed check; the case goes on.
  virtual void fail(const char* file, int line, const std::string& what) = 0;
  /// Ends the case as skipped (throws).
  [[noreturn]] virtual void skip(const std::string& why) = 0;
};

/// One case of the suite.
struct conformance_case {
  const char* name;
  void (*run)(backend_fixture&);
};

#define CCALLOC_CONF_CHECK(f, cond)                             \
  do {                                                          \
    if (!(cond)) (f).fail(__FILE__, __LINE__, "CHECK " #cond); \
  } while (0)
// `stmt` must throw backend_error whose message contains `needle`.
#define CCALLOC_CONF_THROWS(f, stmt, needle)                                                              \
  do {                                                                                                    \
    bool conf_thrown_ = false;                                                                            \
    try {                                                                                                 \
      stmt;                                                                                               \
    } catch (const ccalloc::backend_error& conf_e_) {                                                     \
      conf_thrown_ = true;                                                                                \
      if (std::string(conf_e_.what()).find(needle) == std::string::npos)                                  \
        (f).fail(__FILE__, __LINE__, std::string(#stmt " threw '") + conf_e_.what() + "', without '" +    \
                                         (needle) + "'");                                                 \
    } catch (const std::exception& conf_other_) {                                                         \
      conf_thrown_ = true;                                                                                \
      (f).fail(__FILE__, __LINE__, std::string(#stmt " threw another exception: ") + conf_other_.what()); \
    }                                                                                                     \
    if (!conf_thrown_) (f).fail(__FILE__, __LINE__, #stmt " did not throw backend_error");               \
  } while (0)

namespace detail {

inline std::vector<unsigned char> pattern(std::size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>((i * 131u + seed * 7u + (i >> 9)) & 0xffu);
  return v;
}

// Runs `body` on a new thread and waits for it; an exception there is a failure.
template <class Body>
void on_other_thread(backend_fixture& f, Body body) {
  std::string error;
  std::thread t([&] {
    try {
      body();
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  t.join();
  if (!error.empty()) f.fail(__FILE__, __LINE__, "on another thread: " + error);
}

// --- devices -----------------------------------------------------------------------

inline void devices(backend_fixture& f) {
  device_backend& b = f.backend();
  CCALLOC_CONF_CHECK(f, !b.name().empty());
  const int n = b.device_count();
  CCALLOC_CONF_CHECK(f, n >= 1);
  const int current = b.current_device();
  CCALLOC_CONF_CHECK(f, current >= 0 && current < n);
  b.set_device(current);
  CCALLOC_CONF_CHECK(f, b.current_device() == current);
  CCALLOC_CONF_THROWS(f, b.set_device(n), "out of range");
  CCALLOC_CONF_THROWS(f, b.set_device(-1), "out of range");
  CCALLOC_CONF_CHECK(f, b.current_device() == current);  // unchanged by the failed calls
  const memory_info info = b.mem_get_info(0);
  CCALLOC_CONF_CHECK(f, info.total_bytes > 0);
  CCALLOC_CONF_CHECK(f, info.free_bytes > 0 && info.free_bytes <= info.total_bytes);
  CCALLOC_CONF_THROWS(f, (void)b.mem_get_info(n), "");
}

// --- segments ----------------------------------------------------------------------

inline void segments(backend_fixture& f) {
  device_backend& b = f.backend();
  for (std::size_t size : {std::size_t{2} * mib, std::size_t{20} * mib + 512}) {
    const memory_info before = b.mem_get_info(0);
    void* p = b.segment_malloc(0, size);
    CCALLOC_CONF_CHECK(f, p != nullptr);
    if (p == nullptr) continue;
    CCALLOC_CONF_CHECK(f, reinterpret_cast<std::uintptr_t>(p) % 512 == 0);
    const memory_info during = b.mem_get_info(0);
    CCALLOC_CONF_CHECK(f, during.free_bytes + size <= before.free_bytes);
    const auto bytes = pattern(size, 3);
    f.write(p, bytes);
    CCALLOC_CONF_CHECK(f, f.read(p, size) == bytes);
    b.segment_free(0, p);
    CCALLOC_CONF_CHECK(f, b.mem_get_info(0).free_bytes > during.free_bytes);
  }
  CCALLOC_CONF_THROWS(f, (void)b.segment_malloc(0, 0), "0 bytes");
}

// Out of memory is a return value, not an exception; the backend works after.
inline void segment_out_of_memory(backend_fixture& f) {
  if (!f.may_fail_calls()) f.skip("makes cudaMalloc fail on purpose");
  device_backend& b = f.backend();
  const memory_info info = b.mem_get_info(0);
  void* p = nullptr;
  try {
    p = b.segment_malloc(0, info.total_bytes + info.total_bytes / 2);
  } catch (const std::exception& e) {
    f.fail(__FILE__, __LINE__, std::string("out of memory threw: ") + e.what());
  }
  CCALLOC_CONF_CHECK(f, p == nullptr);
  void* q = b.segment_malloc(0, 2 * mib);
  CCALLOC_CONF_CHECK(f, q != nullptr);
  if (q != nullptr) b.segment_free(0, q);
}

inline void segment_free_of_a_foreign_pointer_throws(backend_fixture& f) {
  if (!f.may_fail_calls()) f.skip("makes cudaFree fail on purpose");
  int host_object = 0;
  CCALLOC_CONF_THROWS(f, f.backend().segment_free(0, &host_object), "");
}

// segment_free waits for the device, as cudaFree does: an event recorded on a
// busy stream before it has completed when it returns (issue 16, item 7).
inline void segment_free_waits_for_the_device(backend_fixture& f) {
  device_backend& b = f.backend();
  const stream_t s = b.create_stream(0);
  const event_t e = b.create_event(0);
  void* p = b.segment_malloc(0, 2 * mib);
  CCALLOC_CONF_CHECK(f, p != nullptr);
  f.keep_busy(s);
  b.record_event(0, e, s);
  if (f.busy_is_observable()) CCALLOC_CONF_CHECK(f, !b.query_event(0, e));
  if (p != nullptr) b.segment_free(0, p);
  CCALLOC_CONF_CHECK(f, b.query_event(0, e));
  b.synchronize_stream(0, s);
  b.destroy_event(0, e);
  b.destroy_stream(0, s);
}

// --- streams and events ----------------------------------------------------------

inline void streams_and_events(backend_fixture& f) {
  device_backend& b = f.backend();
  const stream_t s1 = b.create_stream(0);
  const stream_t s2 = b.create_stream(0);
  CCALLOC_CONF_CHECK(f, s1 != default_stream && s2 != default_stream && s1 != s2);
  const event_t e1 = b.create_event(0);
  const event_t e2 = b.create_event(0);
  CCALLOC_CONF_CHECK(f, e1 != 0 && e2 != 0 && e1 != e2);
  CCALLOC_CONF_CHECK(f, !b.is_capturing(0, s1));
  CCALLOC_CONF_CHECK(f, !b.is_capturing(0, default_stream));

  // An idle stream: the event completes (synchronize_event returns).
  b.record_event(0, e1, s1);
  b.synchronize_event(0, e1);
  CCALLOC_CONF_CHECK(f, b.query_event(0, e1));

  // A busy stream: not complete until synchronize_stream returns.
  f.keep_busy(s1);
  b.record_event(0, e1, s1);
  if (f.busy_is_observable()) CCALLOC_CONF_CHECK(f, !b.query_event(0, e1));
  b.synchronize_stream(0, s1);
  CCALLOC_CONF_CHECK(f, b.query_event(0, e1));

  // Streams are independent; synchronize_device waits for all of them.
  f.keep_busy(s2);
  b.record_event(0, e2, s2);
  b.record_event(0, e1, s1);
  b.synchronize_event(0, e1);  // s1 is idle: returns at once
  if (f.busy_is_observable()) CCALLOC_CONF_CHECK(f, !b.query_event(0, e2));
  b.synchronize_device(0);
  CCALLOC_CONF_CHECK(f, b.query_event(0, e2));

  // A device-side wait (stream_wait_event): s2's later work runs after the
  // work s1 had queued when e1 was recorded; the host does not wait.
  if (b.capabilities().stream_wait) {
    f.keep_busy(s1);
    b.record_event(0, e1, s1);
    b.stream_wait_event(0, s2, e1);
    b.record_event(0, e2, s2);
    if (f.busy_is_observable()) CCALLOC_CONF_CHECK(f, !b.query_event(0, e2));
    b.synchronize_event(0, e2);
    CCALLOC_CONF_CHECK(f, b.query_event(0, e1));
  }

  // The legacy default stream is a stream too.
  b.record_event(0, e1, default_stream);
  b.synchronize_stream(0, default_stream);
  CCALLOC_CONF_CHECK(f, b.query_event(0, e1));

  b.destroy_event(0, e1);
  b.destroy_event(0, e2);
  b.destroy_stream(0, s1);
  b.destroy_stream(0, s2);
}

// --- special stream handles (issue 16, item 4) ---------------------------------------

inline void special_stream_handles(backend_fixture& f) {
  device_backend& b = f.backend();
  const stream_t s = b.create_stream(0);
  CCALLOC_CONF_CHECK(f, b.resolve_stream(0, default_stream) == default_stream);
  CCALLOC_CONF_CHECK(f, b.resolve_stream(0, legacy_stream_handle) == default_stream);
  CCALLOC_CONF_CHECK(f, b.resolve_stream(0, s) == s);
  CCALLOC_CONF_CHECK(f, !device_backend::is_per_thread_stream(s));
  const stream_t mine = b.resolve_stream(0, per_thread_stream_handle);
  CCALLOC_CONF_CHECK(f, mine == b.resolve_stream(0, per_thread_stream_handle));
  CCALLOC_CONF_CHECK(f, mine != per_thread_stream_handle && mine != default_stream && mine != s);
  CCALLOC_CONF_CHECK(f, device_backend::is_per_thread_stream(mine));
  CCALLOC_CONF_CHECK(f, device_backend::is_calling_thread_stream(mine));
  CCALLOC_CONF_CHECK(f, b.resolve_stream(0, mine) == mine);  // resolving twice changes nothing
  stream_t theirs = 0;
  bool mine_is_theirs = true;
  on_other_thread(f, [&] {
    theirs = b.resolve_stream(0, per_thread_stream_handle);
    mine_is_theirs = device_backend::is_calling_thread_stream(mine);
  });
  CCALLOC_CONF_CHECK(f, theirs != mine && device_backend::is_per_thread_stream(theirs));
  CCALLOC_CONF_CHECK(f, !mine_is_theirs);
  CCALLOC_CONF_CHECK(f, !device_backend::is_calling_thread_stream(theirs));
  CCALLOC_CONF_THROWS(f, (void)b.resolve_stream(b.device_count(), per_thread_stream_handle), "out of range");
  b.destroy_stream(0, s);
}

// is_stream tells a live stream of the device from what is not one (the
// allocator asks it once per stream it meets): the default stream and this
// thread's per-thread stream are; another thread's per-thread stream (no
// thread can name it), and a stream of another device, are not. (A
// destroyed handle is not asked: CUDA calls it undefined.)
inline void is_stream_tells_live_streams(backend_fixture& f) {
  device_backend& b = f.backend();
  const stream_t s = b.create_stream(0);
  CCALLOC_CONF_CHECK(f, b.is_stream(0, s));
  CCALLOC_CONF_CHECK(f, b.is_stream(0, default_stream));
  const stream_t mine = b.resolve_stream(0, per_thread_stream_handle);
  CCALLOC_CONF_CHECK(f, b.is_stream(0, mine));
  stream_t theirs = 0;
  on_other_thread(f, [&] { theirs = b.resolve_stream(0, per_thread_stream_handle); });
  CCALLOC_CONF_CHECK(f, !b.is_stream(0, theirs));
  CCALLOC_CONF_THROWS(f, (void)b.is_stream(b.device_count(), s), "out of range");
  if (b.device_count() >= 2) {
    const stream_t other = b.create_stream(1);
    CCALLOC_CONF_CHECK(f, b.is_stream(1, other));
    CCALLOC_CONF_CHECK(f, !b.is_stream(0, other));
    CCALLOC_CONF_CHECK(f, !b.is_stream(1, s));
    b.destroy_stream(1, other);
  }
  b.destroy_stream(0, s);
}

// Work on this thread's per-thread default stream is waited for through its
// resolved handle, here and from another thread.
inline void per_thread_stream_orders_work(backend_fixture& f) {
  device_backend& b = f.backend();
  const stream_t mine = b.resolve_stream(0, per_thread_stream_handle);
  const event_t e = b.create_event(0);
  f.keep_busy(per_thread_stream_handle);
  b.record_event(0, e, per_thread_stream_handle);
  if (f.busy_is_observable()) CCALLOC_CONF_CHECK(f, !b.query_event(0, e));
  b.synchronize_stream(0, mine);
  CCALLOC_CONF_CHECK(f, b.query_event(0, e));

  // From another thread, which cannot name this thread's stream on CUDA.
  f.keep_busy(per_thread_stream_handle);
  bool pending_there = false;
  bool complete_after_wait = false;
  on_other_thread(f, [&] {
    b.record_event(0, e, mine);
    pending_there = !b.query_event(0, e);
    b.synchronize_event(0, e);
    complete_after_wait = b.query_event(0, e);
  });
  if (f.busy_is_observable()) CCALLOC_CONF_CHECK(f, pending_there);
  CCALLOC_CONF_CHECK(f, complete_after_wait);
  f.keep_busy(per_thread_stream_handle);
  b.record_event(0, e, mine);
  on_other_thread(f, [&] { b.synchronize_stream(0, mine); });
  CCALLOC_CONF_CHECK(f, b.query_event(0, e));
  b.synchronize_device(0);
  b.destroy_event(0, e);
}

// --- optional functions and capabilities ------------------------------------------------

inline void virtual_memory(backend_fixture& f) {
  device_backend& b = f.backend();
  const backend_capabilities caps = b.capabilities();
  if (caps.ipc_vm) CCALLOC_CONF_CHECK(f, caps.virtual_memory);
  if (!caps.virtual_memory) {
    CCALLOC_CONF_THROWS(f, (void)b.vm_granularity(0), "not supported");
    CCALLOC_CONF_THROWS(f, (void)b.vm_reserve(0, 2 * mib), "not supported");
    physical_handle_t h = 0;
    CCALLOC_CONF_THROWS(f, (void)b.vm_create(0, 2 * mib, &h), "not supported");
    return;
  }
  const std::size_t g = b.vm_granularity(0);
  CCALLOC_CONF_CHECK(f, g > 0 && (g & (g - 1)) == 0);
  void* base = b.vm_reserve(0, 4 * g);
  CCALLOC_CONF_CHECK(f, base != nullptr && reinterpret_cast<std::uintptr_t>(base) % g == 0);
  if (base == nullptr) return;
  const memory_info before = b.mem_get_info(0);
  physical_handle_t h1 = 0;
  physical_handle_t h2 = 0;
  CCALLOC_CONF_CHECK(f, b.vm_create(0, g, &h1) && h1 != 0);
  CCALLOC_CONF_CHECK(f, b.vm_create(0, g, &h2) && h2 != 0 && h2 != h1);
  CCALLOC_CONF_CHECK(f, b.mem_get_info(0).free_bytes + 2 * g <= before.free_bytes);
  auto* page1 = static_cast<unsigned char*>(base) + g;
  b.vm_map(0, page1, g, h1);
  b.vm_map(0, page1 + g, g, h2);
  const auto bytes = pattern(2 * g, 5);
  f.write(page1, bytes);  // across the two mappings
  CCALLOC_CONF_CHECK(f, f.read(page1, 2 * g) == bytes);
  // A handle keeps its contents when mapped again elsewhere.
  b.vm_unmap(0, page1, g);  // one mapping per call (what the allocator does)
  b.vm_unmap(0, page1 + g, g);
  b.vm_map(0, base, g, h2);
  CCALLOC_CONF_CHECK(f, f.read(base, g) == std::vector<unsigned char>(bytes.begin() + static_cast<std::ptrdiff_t>(g),
                                                                      bytes.end()));
  b.vm_unmap(0, base, g);
  b.vm_release_handle(0, h1);
  b.vm_release_handle(0, h2);
  b.vm_release(0, base, 4 * g);
  if (f.may_fail_calls()) {
    // Out of memory is a return value.
    physical_handle_t big = 0;
    const std::size_t too_much = (before.total_bytes / g + 1) * g * 2;
    bool created = true;
    try {
      created = b.vm_create(0, too_much, &big);
    } catch (const std::exception& e) {
      f.fail(__FILE__, __LINE__, std::string("vm_create out of memory threw: ") + e.what());
    }
    CCALLOC_CONF_CHECK(f, !created);
    if (created) b.vm_release_handle(0, big);
  }
}

inline void peers(backend_fixture& f) {
  device_backend& b = f.backend();
  CCALLOC_CONF_CHECK(f, !b.can_access_peer(0, 0));
  if (!b.capabilities().peer_access) {
    CCALLOC_CONF_THROWS(f, b.enable_peer_access(0, b.device_count() > 1 ? 1 : 0), "");
    return;
  }
  if (b.device_count() < 2 || !b.can_access_peer(0, 1)) f.skip("one device, or no peer path from device 0 to 1");
  b.enable_peer_access(0, 1);
  b.enable_peer_access(0, 1);  // again: not an error
}

inline void gates(backend_fixture& f) {
  device_backend& b = f.backend();
  if (!b.capabilities().gates) {
    CCALLOC_CONF_THROWS(f, (void)b.create_gate(0), "not supported");
    return;
  }
  const stream_t s = b.create_stream(0);
  const event_t e = b.create_event(0);
  const gate_t g = b.create_gate(0);
  CCALLOC_CONF_CHECK(f, g != 0);
  b.wait_gate(0, s, g);
  b.record_event(0, e, s);
  CCALLOC_CONF_CHECK(f, !b.query_event(0, e));  // deterministic: the gate is closed
  b.open_gate(0, g);
  b.open_gate(0, g);  // opening an open gate does nothing
  b.synchronize_event(0, e);
  CCALLOC_CONF_CHECK(f, b.query_event(0, e));
  b.synchronize_stream(0, s);
  b.destroy_gate(0, g);
  b.destroy_event(0, e);
  b.destroy_stream(0, s);
}

inline void copies(backend_fixture& f) {
  device_backend& b = f.backend();
  constexpr std::size_t n = 3 * mib + 100;
  void* src = b.segment_malloc(0, n);
  void* dst = b.segment_malloc(0, n);
  CCALLOC_CONF_CHECK(f, src != nullptr && dst != nullptr);
  if (src == nullptr || dst == nullptr) return;
  const stream_t s = b.create_stream(0);
  const auto bytes = pattern(n, 9);
  f.write(src, bytes);
  f.write(dst, std::vector<unsigned char>(n, 0));
  b.copy_data(0, dst, src, n);
  CCALLOC_CONF_CHECK(f, f.read(dst, n) == bytes);
  f.write(dst, std::vector<unsigned char>(n, 0));
  b.memcpy_async(0, dst, src, n, s);
  b.synchronize_stream(0, s);
  CCALLOC_CONF_CHECK(f, f.read(dst, n) == bytes);
  f.write(dst, std::vector<unsigned char>(n, 0));
  b.memcpy_peer_async(dst, 0, src, 0, n, s);
  b.synchronize_stream(0, s);
  CCALLOC_CONF_CHECK(f, f.read(dst, n) == bytes);
  // Size 0 does nothing.
  f.write(dst, std::vector<unsigned char>(16, 1));
  b.copy_data(0, dst, src, 0);
  b.memcpy_async(0, dst, src, 0, s);
  b.memcpy_peer_async(dst, 0, src, 0, 0, s);
  b.synchronize_stream(0, s);
  CCALLOC_CONF_CHECK(f, f.read(dst, 16) == std::vector<unsigned char>(16, 1));
  b.destroy_stream(0, s);
  b.segment_free(0, src);
  b.segment_free(0, dst);
}

inline void ipc(backend_fixture& f) {
  device_backend& b = f.backend();
  if (!b.capabilities().ipc) {
    int host_object = 0;
    CCALLOC_CONF_THROWS(f, (void)b.ipc_export_segment(0, &host_object), "not supported");
    return;
  }
  void* p = b.segment_malloc(0, 2 * mib);
  CCALLOC_CONF_CHECK(f, p != nullptr);
  if (p == nullptr) return;
  const ipc_mem_handle h = b.ipc_export_segment(0, p);
  bool any = false;
  for (std::uint8_t byte : h.bytes) any = any || byte != 0;
  CCALLOC_CONF_CHECK(f, any);
  if (f.may_fail_calls()) {
    // A process cannot open its own export (CUDA's rule, kept by the sim).
    CCALLOC_CONF_THROWS(f, (void)b.ipc_open_segment(0, h), "");
    int host_object = 0;
    CCALLOC_CONF_THROWS(f, (void)b.ipc_export_segment(0, &host_object), "");
  }
  b.segment_free(0, p);
}

}  // namespace detail

/// Every case, in order.
inline const std::vector<conformance_case>& all_cases() {
  static const std::vector<conformance_case> cases = {
      {"devices", detail::devices},
      {"segments", detail::segments},
      {"segment_out_of_memory", detail::segment_out_of_memory},
      {"segment_free_of_a_foreign_pointer_throws", detail::segment_free_of_a_foreign_pointer_throws},
      {"segment_free_waits_for_the_device", detail::segment_free_waits_for_the_device},
      {"streams_and_events", detail::streams_and_events},
      {"special_stream_handles", detail::special_stream_handles},
      {"is_stream_tells_live_streams", detail::is_stream_tells_live_streams},
      {"per_thread_stream_orders_work", detail::per_thread_stream_orders_work},
      {"virtual_memory", detail::virtual_memory},
      {"peers", detail::peers},
      {"gates", detail::gates},
      {"copies", detail::copies},
      {"ipc", detail::ipc},
  };
  return cases;
}

}  // namespace ccalloc::conformance
