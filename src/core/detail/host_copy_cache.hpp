// Host buffers for the kept contents of paused tags (sleep and wake), kept
// after a resume for the next pause. Pinning host memory (cudaHostAlloc)
// costs more than the copy it serves: on an H200 host a pause of 1 GiB with
// its contents took 397 ms, the copy itself about 20 ms (docs/perf.md,
// "On the H200 (2026-12-05)"), and a sleep-and-wake loop pauses the same
// bytes every round.
//
// Policy: a buffer a resume gives back is kept; a pause takes a kept buffer
// of the size it needs, else the smallest kept one of at most 5/4 of it,
// else asks the backend (host_alloc). Kept bytes never exceed the largest
// total of host copies held at once so far (a buffer is only kept after it
// was in use). Out of host memory, the kept buffers go back to the backend
// and it is asked once more. release_all() gives every kept buffer back
// (empty_cache, teardown).
//
// Not thread-safe: [world] (pause, resume and empty_cache hold it).
#pragma once
#include <ccalloc/backend/device_backend.hpp>

#include <cstddef>
#include <map>
#include <unordered_map>

namespace ccalloc::detail {

class host_copy_cache {
 public:
  host_copy_cache(device_backend& backend, int device) noexcept : backend_(backend), device_(device) {}
  host_copy_cache(const host_copy_cache&) = delete;
  host_copy_cache& operator=(const host_copy_cache&) = delete;
  ~host_copy_cache() { release_all(); }

  /// A host buffer of at least `bytes` (> 0) for copies with the device;
  /// nullptr when the host has none even after the kept buffers went back.
  /// May throw std::bad_alloc (its own books), having changed nothing.
  [[nodiscard]] void* take(std::size_t bytes) {
    auto it = kept_.lower_bound(bytes);
    if (it != kept_.end() && it->first <= bytes + bytes / 4) {
      out_.emplace(it->second, it->first);  // may throw: nothing changed yet
      void* p = it->second;
      kept_bytes_ -= it->first;
      kept_.erase(it);
      return p;
    }
    out_.reserve(out_.size() + 1);
    void* p = backend_.host_alloc(device_, bytes);
    if (p == nullptr && !kept_.empty()) {
      release_all();
      p = backend_.host_alloc(device_, bytes);
    }
    if (p != nullptr) out_.emplace(p, bytes);  // room reserved above
    return p;
  }

  /// Gives back a buffer from take (nullptr: nothing); the copies that used
  /// it must have completed. It is kept for a later take.
  void give(void* p) noexcept {
    if (p == nullptr) return;
    const auto it = out_.find(p);
    if (it == out_.end()) return;  // not one of take's: nothing to keep
    const std::size_t bytes = it->second;
    out_.erase(it);
    try {
      kept_.emplace(bytes, p);
      kept_bytes_ += bytes;
    } catch (...) {  // no memory for the books: the buffer goes back instead
      backend_.host_free(device_, p);
    }
  }

  /// Every kept buffer back to the backend (buffers in use stay).
  void release_all() noexcept {
    for (const auto& [bytes, p] : kept_) backend_.host_free(device_, p);
    kept_.clear();
    kept_bytes_ = 0;
  }

  /// Bytes kept for later pauses, and bytes in use by paused tags now.
  [[nodiscard]] std::size_t kept_bytes() const noexcept { return kept_bytes_; }

 private:
  device_backend& backend_;
  int device_;
  std::multimap<std::size_t, void*> kept_;     // by size
  std::unordered_map<void*, std::size_t> out_; // taken, by address -> bytes
  std::size_t kept_bytes_ = 0;
};

}  // namespace ccalloc::detail
