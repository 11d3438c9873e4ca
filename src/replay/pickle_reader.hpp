// pickle_reader.hpp: a reader of the plain-data subset of Python's pickle
// format (protocols 2 to 5) that PyTorch memory snapshots use: dicts, lists,
// tuples, strings, bytes, integers, floats, booleans and None. Internal to
// the replay library (snapshot_reader.cpp).
//
// It never runs code: an opcode that names a class or a function (GLOBAL,
// STACK_GLOBAL, REDUCE, BUILD, NEWOBJ...) is refused with an error.
//
// Cost is linear in the input: every opcode does bounded work besides
// copying its own items, and each container is stored once. Containers are
// frozen when they are put into another one (a pickler writes a container
// whole before its parent takes it) and shared by content: equal strings are
// stored once and so are equal containers, so a snapshot whose frames are
// distinct objects with repeated contents (the usual case) takes memory for
// its distinct frames only. A pickle that changes a container after putting
// it into another (only recursive structures do that) is refused.
//
// Memory: the memo (8 bytes per memoized object), the distinct strings, 8
// bytes per item of each distinct container plus 24 bytes per container,
// and a 1 MiB input buffer; every opcode adds at most about 50 bytes per
// byte of its own, and limits::max_memory bounds the total. The input is read as a stream (read_fn), never
// whole.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace ccalloc::pickle {

/// A malformed, unsupported or over-limit pickle; what() is the reason
/// without the file name.
class pickle_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A value of the tree: a tag in the low 4 bits, a payload above.
using value = std::uint64_t;

enum class kind : std::uint8_t { none, boolean, integer, wide_integer, huge_integer, floating, str, bytes, list, dict, tuple };

/// "None", "a bool", "an int", ... for messages.
[[nodiscard]] std::string_view describe(kind k) noexcept;

/// The unpickled tree. Containers are immutable once read; equal contents
/// share one container id.
class tree {
 public:
  [[nodiscard]] static kind kind_of(value v) noexcept;
  /// A non-negative integer that fits 64 bits: true and `out` set, else false.
  [[nodiscard]] bool as_uint(value v, std::uint64_t& out) const noexcept;
  /// Booleans as 0/1, integers as themselves: true when `v` is one of them and nonzero.
  [[nodiscard]] bool truthy(value v) const noexcept;
  [[nodiscard]] std::string_view text(value v) const noexcept;  ///< str or bytes, else ""
  /// The items of a list or tuple, or the keys and values of a dict
  /// interleaved; empty for anything else.
  [[nodiscard]] const value* items(value v, std::size_t& count) const noexcept;
  /// The value of `key` (a str) in dict `d` (the last one if repeated), or
  /// false when `d` is not a dict or has no such key.
  [[nodiscard]] bool get(value d, std::string_view key, value& out) const;
  /// The container id of a list, dict or tuple (equal contents, equal ids).
  [[nodiscard]] static std::uint64_t id(value v) noexcept { return v >> 4; }

  value root = 0;
  std::uint64_t bytes = 0;  ///< pickle bytes read, up to STOP

 private:
  friend class reader;
  struct container {
    std::uint64_t offset;
    std::uint32_t count;
    kind k;
  };
  std::vector<container> containers_;
  std::vector<value> items_;
  std::deque<std::string> strings_;
  std::vector<double> floats_;
  std::vector<std::uint64_t> wide_;
};

/// Limits, each checked while reading.
struct limits {
  std::uint64_t max_objects = 0;  ///< values made by opcodes (memo gets are not counted)
  std::uint64_t max_bytes = 0;    ///< pickle bytes read
  /// Bytes of memory built: 8 per value pushed or memoized, a container's
  /// items and 24 bytes, a distinct string's text and 64 bytes (freed
  /// memory is not given back, so this bounds the peak from above).
  std::uint64_t max_memory = 0;
};

/// Fills `buffer` with up to `size` bytes of the (decompressed) pickle;
/// returns how many, 0 at the end. May throw pickle_error.
using read_fn = std::function<std::size_t(char* buffer, std::size_t size)>;

/// Thrown for an exceeded limit; `which` is 0 for objects, 1 for bytes, 2 for memory.
class limit_error : public pickle_error {
 public:
  limit_error(const std::string& what, int which_limit) : pickle_error(what), which(which_limit) {}
  int which;
};

/// Reads one pickle from `read` up to its STOP opcode. `on_bytes(n)` is told
/// the number of pickle bytes read so far, every few MiB. Throws
/// pickle_error (reason only) or limit_error.
[[nodiscard]] tree read(const read_fn& read, const limits& lim, const std::function<void(std::uint64_t)>& on_bytes);

}  // namespace ccalloc::pickle
