// pickle_writer.hpp: writes pickle opcodes (protocol 4) for tests of the
// PyTorch snapshot reader: valid snapshots of any shape, memo references,
// and malformed pickles byte by byte.
//
//   pickle_writer p;
//   p.dict().key("device_traces").list().list().end_list().end_list().end_dict();
//   std::string bytes = p.done();  // {"device_traces": [[]]}
//
// dict()/list() open a container (EMPTY_DICT/EMPTY_LIST, MEMOIZE, MARK);
// end_dict()/end_list() close it (SETITEMS/APPENDS). memo() numbers follow
// pickle.Pickler's: the n-th MEMOIZE stores index n - 1.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace ccalloc::testing {

class pickle_writer {
 public:
  pickle_writer() : bytes_("\x80\x04", 2) {}

  pickle_writer& raw(std::string_view b) {
    bytes_ += b;
    return *this;
  }
  pickle_writer& memo() {
    bytes_ += '\x94';
    ++memo_;
    return *this;
  }
  /// The memo index the next memo() stores.
  [[nodiscard]] std::uint32_t next_memo() const { return memo_; }
  pickle_writer& get(std::uint32_t index) {
    bytes_ += 'j';
    le(index, 4);
    return *this;
  }
  pickle_writer& dict() { return raw("}").memo().raw("("); }
  pickle_writer& end_dict() { return raw("u"); }
  pickle_writer& list() { return raw("]").memo().raw("("); }
  pickle_writer& end_list() { return raw("e"); }
  pickle_writer& str(std::string_view s) {
    if (s.size() < 256) {
      bytes_ += '\x8c';
      bytes_ += static_cast<char>(s.size());
    } else {
      bytes_ += 'X';
      le(s.size(), 4);
    }
    bytes_ += s;
    return memo();
  }
  pickle_writer& key(std::string_view s) { return str(s); }
  pickle_writer& num(std::int64_t v) {
    if (v >= 0 && v < 256) {
      bytes_ += 'K';
      le(static_cast<std::uint64_t>(v), 1);
    } else if (v >= -(std::int64_t{1} << 31) && v < (std::int64_t{1} << 31)) {
      bytes_ += 'J';
      le(static_cast<std::uint64_t>(v), 4);
    } else {
      bytes_ += '\x8a';
      bytes_ += '\x08';
      le(static_cast<std::uint64_t>(v), 8);
    }
    return *this;
  }
  pickle_writer& field(std::string_view k, std::int64_t v) { return key(k).num(v); }
  pickle_writer& field(std::string_view k, std::string_view v) { return key(k).str(v); }
  /// The pickle, with STOP.
  [[nodiscard]] std::string done() const { return bytes_ + "."; }
  [[nodiscard]] std::size_t size() const { return bytes_.size(); }

 private:
  void le(std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) bytes_ += static_cast<char>((v >> (8 * i)) & 0xFF);
  }
  std::string bytes_;
  std::uint32_t memo_ = 0;
};

}  // namespace ccalloc::testing
