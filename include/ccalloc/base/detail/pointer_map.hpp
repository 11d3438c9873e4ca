// ccalloc/base/detail/pointer_map.hpp: an open-addressing hash map from a
// pointer to a small value, for the front end's pointer lookup. Not part of
// the public API; not thread-safe (callers hold a lock).
//
// Linear probing with backward-shift deletion (no tombstones), capacity a
// power of two, load kept under 1/2. Key 0 marks an empty slot (a null
// pointer is never stored). No allocation except when growing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

namespace ccalloc::detail {

template <class Value>
class pointer_map {
 public:
  pointer_map() { rehash(16); }

  [[nodiscard]] std::size_t size() const noexcept { return size_; }

  /// Inserts key -> value; returns false (and changes nothing) if key is present.
  [[gnu::always_inline]] bool insert(std::uintptr_t key, const Value& value) {
    if ((size_ + 1) * 2 > capacity_) [[unlikely]]
      rehash(capacity_ * 2);
    std::size_t i = slot_of(key);
    while (slots_[i].key != 0) {
      if (slots_[i].key == key) return false;
      i = (i + 1) & mask_;
    }
    slots_[i] = {key, value};
    ++size_;
    return true;
  }

  /// The value of key, or nullptr (always for key 0, the empty slots' key).
  [[nodiscard]] Value* find(std::uintptr_t key) noexcept {
    if (key == 0) [[unlikely]]
      return nullptr;
    for (std::size_t i = slot_of(key);; i = (i + 1) & mask_) {
      if (slots_[i].key == key) return &slots_[i].value;
      if (slots_[i].key == 0) return nullptr;
    }
  }

  /// Removes key and stores its value in *out; false if absent (always for key 0).
  [[gnu::always_inline]] bool erase(std::uintptr_t key, Value* out) noexcept {
    if (key == 0) [[unlikely]]
      return false;
    std::size_t i = slot_of(key);
    for (;; i = (i + 1) & mask_) {
      if (slots_[i].key == key) break;
      if (slots_[i].key == 0) return false;
    }
    *out = slots_[i].value;
    // Backward shift: pull later entries of the probe run into the hole.
    for (std::size_t j = (i + 1) & mask_; slots_[j].key != 0; j = (j + 1) & mask_) {
      const std::size_t home = slot_of(slots_[j].key);
      // Move j to i if i lies cyclically in [home, j).
      if (((j - home) & mask_) >= ((j - i) & mask_)) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i].key = 0;
    --size_;
    return true;
  }

 private:
  struct slot {
    std::uintptr_t key = 0;
    Value value{};
  };

  [[nodiscard]] std::size_t slot_of(std::uintptr_t key) const noexcept {
    // Allocations are 512-byte aligned: drop those bits, then mix (Fibonacci).
    return static_cast<std::size_t>(((key >> 9) * 0x9E3779B97F4A7C15ull) >> shift_);
  }

  [[gnu::noinline]] void rehash(std::size_t capacity) {
    auto old = std::move(slots_);
    const std::size_t old_capacity = capacity_;
    slots_ = std::make_unique<slot[]>(capacity);
    capacity_ = capacity;
    mask_ = capacity - 1;
    shift_ = 64 - static_cast<unsigned>(__builtin_ctzll(capacity));
    size_ = 0;
    for (std::size_t i = 0; i < old_capacity; ++i)
      if (old[i].key != 0) insert(old[i].key, old[i].value);
  }

  std::unique_ptr<slot[]> slots_;
  std::size_t capacity_ = 0;
  std::size_t mask_ = 0;
  unsigned shift_ = 64;
  std::size_t size_ = 0;
};

}  // namespace ccalloc::detail
