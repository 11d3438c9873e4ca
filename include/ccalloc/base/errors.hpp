// ccalloc/base/errors.hpp: the exceptions ccalloc throws.
//
// Every error derives from ccalloc::error (a std::runtime_error), so callers
// can catch one type. The message always names what was wrong (the pointer,
// the key and value, the file and line) and, where useful, what to do.
// After any of these is thrown the allocator's state is as it was before the
// call (SPEC R5), except out_of_memory_error, after which cached memory may
// have been returned to the device while trying to satisfy the request.
// docs/errors.md lists every message.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

namespace ccalloc {

/// Base of every exception thrown by ccalloc.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A caller passed something invalid: an unknown or already freed pointer, a
/// device index out of range, a memory fraction outside [0, 1], an
/// uninitialized allocator.
class invalid_argument_error : public error {
 public:
  using error::error;
};

/// A configuration string (CCALLOC_CONF or set at run time) has an unknown
/// key, a bad value or bad syntax. The message names the key, the value and
/// what is accepted.
class config_error : public error {
 public:
  using error::error;
};

/// A device backend call failed for a reason other than running out of memory
/// (a CUDA error, an injected fault, an unsupported operation).
class backend_error : public error {
 public:
  using error::error;
};

/// The host, not the device, lacked memory a backend needed: the simulated
/// device could not map the memory it has free (an mmap refused with ENOMEM,
/// e.g. under an address-space limit, ulimit -v). Not an out-of-memory of
/// the device: the device's free figures would say the memory is there.
/// The ccalloc CLI reports it as "out of host memory while <step> (...)",
/// as it reports std::bad_alloc.
class host_memory_error : public backend_error {
 public:
  using backend_error::backend_error;
};

/// The device could not provide memory even after the allocator freed its
/// cache (SPEC B6). Carries the figures the message states.
class out_of_memory_error : public error {
 public:
  /// Fields, in order: device, requested_bytes, device_total_bytes,
  /// device_free_bytes, allocated_bytes, reserved_bytes.
  struct figures {
    int device = 0;
    std::size_t requested_bytes = 0;
    std::size_t device_total_bytes = 0;
    std::size_t device_free_bytes = 0;
    std::size_t allocated_bytes = 0;
    std::size_t reserved_bytes = 0;
  };
  out_of_memory_error(std::string message, const figures& f)
      : error(std::move(message)),
        device(f.device),
        requested_bytes(f.requested_bytes),
        device_total_bytes(f.device_total_bytes),
        device_free_bytes(f.device_free_bytes),
        allocated_bytes(f.allocated_bytes),
        reserved_bytes(f.reserved_bytes) {}

  int device;                      ///< device index
  std::size_t requested_bytes;     ///< what the caller asked for (unrounded)
  std::size_t device_total_bytes;  ///< device total, or the fraction cap if set
  std::size_t device_free_bytes;   ///< device free memory at failure
  std::size_t allocated_bytes;     ///< bytes allocated by this allocator on the device
  std::size_t reserved_bytes;      ///< bytes reserved (segments) on the device
};

}  // namespace ccalloc
