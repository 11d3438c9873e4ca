// pickle_reader.cpp: the plain-data pickle reader (pickle_reader.hpp).
//
// A stack machine over the opcodes of Python's Lib/pickletools.py that a
// plain-data pickle of protocol 2 to 5 uses. Values are 64-bit words: a
// 4-bit tag and a payload (a small integer, a string id, a container id or,
// for a list or dict made by the pickle, its serial number).
#include "pickle_reader.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <string>
#include <unordered_map>

namespace ccalloc::pickle {

namespace {

enum tag : std::uint64_t {
  t_none = 0,
  t_bool = 1,
  t_int = 2,    // payload: a signed 60-bit integer
  t_wide = 3,   // payload: index into wide_ (integers 2^59 .. 2^64-1)
  t_huge = 4,   // an integer outside -2^59 .. 2^64-1 (no payload)
  t_float = 5,  // payload: index into floats_
  t_str = 6,    // payload: string id
  t_bytes = 7,  // payload: string id
  t_list = 8,   // payload: container id (frozen)
  t_dict = 9,
  t_tuple = 10,
  t_open = 11,   // a list or dict made by this pickle: its serial number (state_)
  t_unset = 15,  // a memo index never stored
};

constexpr value make(tag t, std::uint64_t payload) noexcept { return (payload << 4) | t; }
constexpr tag tag_of(value v) noexcept { return static_cast<tag>(v & 15u); }
constexpr std::uint64_t payload(value v) noexcept { return v >> 4; }
constexpr std::int64_t small_min = -(std::int64_t{1} << 59);
constexpr std::int64_t small_max = (std::int64_t{1} << 59) - 1;

std::uint64_t mix(std::uint64_t h, std::uint64_t x) noexcept {
  h ^= x + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  h *= 0xFF51AFD7ED558CCDull;
  return h ^ (h >> 29);
}

std::string hex_byte(int op) {
  static constexpr char digits[] = "0123456789abcdef";
  return std::string("0x") + digits[(op >> 4) & 15] + digits[op & 15];
}

/// Opcode names for messages (Lib/pickletools.py's names).
std::string opcode_name(int op) {
  switch (op) {
    case 'c': return "GLOBAL";
    case 0x93: return "STACK_GLOBAL";
    case 'R': return "REDUCE";
    case 'b': return "BUILD";
    case 'i': return "INST";
    case 'o': return "OBJ";
    case 0x81: return "NEWOBJ";
    case 0x92: return "NEWOBJ_EX";
    case 'P': return "PERSID";
    case 'Q': return "BINPERSID";
    case 0x82: case 0x83: case 0x84: return "EXT";
    case 0x8f: return "EMPTY_SET";
    case 0x90: return "ADDITEMS";
    case 0x91: return "FROZENSET";
    case 0x97: return "NEXT_BUFFER";
    case 0x98: return "READONLY_BUFFER";
    case 'I': return "INT";
    case 'L': return "LONG";
    case 'F': return "FLOAT";
    case 'S': return "STRING";
    case 'V': return "UNICODE";
    case 'p': return "PUT";
    case 'g': return "GET";
    default: return hex_byte(op);
  }
}

}  // namespace

std::string_view describe(kind k) noexcept {
  switch (k) {
    case kind::none: return "None";
    case kind::boolean: return "a bool";
    case kind::integer: return "an int";
    case kind::wide_integer: return "an int";
    case kind::huge_integer: return "an int out of range";
    case kind::floating: return "a float";
    case kind::str: return "a str";
    case kind::bytes: return "bytes";
    case kind::list: return "a list";
    case kind::dict: return "a dict";
    case kind::tuple: return "a tuple";
  }
  return "a value";
}

kind tree::kind_of(value v) noexcept {
  switch (tag_of(v)) {
    case t_none: return kind::none;
    case t_bool: return kind::boolean;
    case t_int: return kind::integer;
    case t_wide: return kind::wide_integer;
    case t_huge: return kind::huge_integer;
    case t_float: return kind::floating;
    case t_str: return kind::str;
    case t_bytes: return kind::bytes;
    case t_list: return kind::list;
    case t_dict: return kind::dict;
    case t_tuple: return kind::tuple;
    default: return kind::none;
  }
}

bool tree::as_uint(value v, std::uint64_t& out) const noexcept {
  if (tag_of(v) == t_int) {
    const auto s = static_cast<std::int64_t>(v) >> 4;
    if (s < 0) return false;
    out = static_cast<std::uint64_t>(s);
    return true;
  }
  if (tag_of(v) == t_wide) {
    out = wide_[payload(v)];
    return true;
  }
  return false;
}

bool tree::truthy(value v) const noexcept {
  if (tag_of(v) == t_bool) return payload(v) != 0;
  if (tag_of(v) == t_int) return payload(v) != 0;
  return tag_of(v) == t_wide;
}

std::string_view tree::text(value v) const noexcept {
  if (tag_of(v) != t_str && tag_of(v) != t_bytes) return {};
  return strings_[payload(v)];
}

const value* tree::items(value v, std::size_t& count) const noexcept {
  const tag t = tag_of(v);
  if (t != t_list && t != t_dict && t != t_tuple) {
    count = 0;
    return nullptr;
  }
  const container& c = containers_[payload(v)];
  count = c.count;
  return items_.data() + c.offset;
}

bool tree::get(value d, std::string_view key, value& out) const {
  if (tag_of(d) != t_dict) return false;
  std::size_t n = 0;
  const value* it = items(d, n);
  for (std::size_t i = n; i >= 2; i -= 2) {
    const value k = it[i - 2];
    if (tag_of(k) == t_str && strings_[payload(k)] == key) {
      out = it[i - 1];
      return true;
    }
  }
  return false;
}

// ---- the reader ----------------------------------------------------------------------

class reader {
 public:
  reader(const read_fn& in, const limits& lim, const std::function<void(std::uint64_t)>& on_bytes)
      : in_(in), lim_(lim), on_bytes_(on_bytes), buf_(std::size_t{1} << 20) {}

  tree run() {
    for (;;) {
      op_at_ = offset();
      const int op = next();
      if (op < 0) fail("it ends before its STOP opcode (truncated)");
      if (step(op)) break;
    }
    return std::move(t_);
  }

 private:
  struct slot {
    std::vector<value> items;
    bool is_dict = false;
  };

  [[noreturn]] void fail(const std::string& why) const {
    throw pickle_error("corrupt pickle at byte " + std::to_string(op_at_) + ": " + why);
  }
  [[noreturn]] void unsupported(int op) const {
    throw pickle_error("pickle opcode " + opcode_name(op) + " at byte " + std::to_string(op_at_) +
                       " is not plain data (a snapshot holds dicts, lists, strings and numbers only)");
  }

  // ---- input ----
  [[nodiscard]] std::uint64_t offset() const noexcept { return consumed_ + pos_; }
  bool fill() {
    consumed_ += end_;
    pos_ = end_ = 0;
    const std::size_t got = in_(buf_.data(), buf_.size());
    end_ = got;
    if (consumed_ + end_ > lim_.max_bytes)
      throw limit_error("the pickle is larger than the limit of " + std::to_string(lim_.max_bytes) + " bytes", 1);
    if (on_bytes_ && consumed_ / (std::uint64_t{16} << 20) != (consumed_ + end_) / (std::uint64_t{16} << 20))
      on_bytes_(consumed_ + end_);
    return got > 0;
  }
  int next() {
    if (pos_ == end_ && !fill()) return -1;
    return static_cast<unsigned char>(buf_[pos_++]);
  }
  /// `n` bytes into `out` (replaced).
  void take(std::uint64_t n, std::string& out) {
    out.clear();
    while (n > 0) {
      if (pos_ == end_ && !fill()) fail("it ends inside an argument (truncated)");
      const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(n, end_ - pos_));
      out.append(buf_.data() + pos_, k);
      pos_ += k;
      n -= k;
    }
  }
  /// A little-endian unsigned integer of `n` <= 8 bytes.
  std::uint64_t le(int n) {
    std::uint64_t v = 0;
    for (int i = 0; i < n; ++i) {
      const int b = next();
      if (b < 0) fail("it ends inside an argument (truncated)");
      v |= std::uint64_t(b) << (8 * i);
    }
    return v;
  }
  /// A '\n'-terminated line (GLOBAL's arguments), at most 256 bytes.
  std::string line() {
    std::string s;
    for (;;) {
      const int b = next();
      if (b < 0) fail("it ends inside an argument (truncated)");
      if (b == '\n') return s;
      if (s.size() == 256) fail("a GLOBAL name longer than 256 bytes");
      s += static_cast<char>(b);
    }
  }

  // ---- values ----
  void count_object() {
    if (++objects_ > lim_.max_objects)
      throw limit_error("the pickle has more than the limit of " + std::to_string(lim_.max_objects) + " objects", 0);
  }
  /// Counts `bytes` of memory built (values on the stack, in containers, in
  /// the memo, strings) against the memory limit; what is freed is not
  /// given back, so the count bounds the peak from above.
  void charge(std::uint64_t bytes) {
    memory_ += bytes;
    if (memory_ > lim_.max_memory)
      throw limit_error("reading the pickle takes more than the limit of " + std::to_string(lim_.max_memory) +
                            " bytes of memory",
                        2);
  }
  void push(value v) {
    count_object();
    charge(sizeof(value));
    stack_.push_back(v);
  }
  value pop() {
    if (stack_.size() <= floor()) fail("an opcode takes a value from an empty stack");
    const value v = stack_.back();
    stack_.pop_back();
    return v;
  }
  [[nodiscard]] std::size_t floor() const noexcept { return marks_.empty() ? 0 : marks_.back(); }
  std::size_t pop_mark() {
    if (marks_.empty()) fail("an opcode needs a MARK and there is none");
    const std::size_t m = marks_.back();
    marks_.pop_back();
    return m;
  }

  value intern_string(tag t, const std::string& s) {
    auto it = string_ids_.find(std::string_view(s));
    if (it != string_ids_.end()) return make(t, it->second);
    charge(s.size() + 64);  // the text, its deque slot and its hash entry
    const std::uint64_t id = t_.strings_.size();
    t_.strings_.push_back(s);
    string_ids_.emplace(std::string_view(t_.strings_.back()), id);
    return make(t, id);
  }
  value integer_le(const std::string& bytes) {
    // Two's complement, little-endian (LONG1, LONG4).
    if (bytes.empty()) return make(t_int, 0);
    const bool negative = (static_cast<unsigned char>(bytes.back()) & 0x80u) != 0;
    std::size_t n = bytes.size();
    // Sign-extension bytes beyond 8 carry no value.
    while (n > 8 && static_cast<unsigned char>(bytes[n - 1]) == (negative ? 0xFFu : 0u)) --n;
    if (n > 9 || (n == 9 && (negative || bytes[8] != 0))) return make(t_huge, 0);
    std::uint64_t u = 0;
    for (std::size_t i = 0; i < std::min<std::size_t>(n, 8); ++i)
      u |= std::uint64_t(static_cast<unsigned char>(bytes[i])) << (8 * i);
    if (negative) {
      if (n < 8) u |= ~std::uint64_t{0} << (8 * n);  // sign-extend
      const auto s = static_cast<std::int64_t>(u);
      return s >= small_min ? make(t_int, static_cast<std::uint64_t>(s)) : make(t_huge, 0);
    }
    return from_uint(u);
  }
  value from_uint(std::uint64_t u) {
    if (u <= static_cast<std::uint64_t>(small_max)) return make(t_int, u);
    charge(sizeof u);
    t_.wide_.push_back(u);
    return make(t_wide, t_.wide_.size() - 1);
  }
  value from_int(std::int64_t s) {
    return s >= 0 ? from_uint(static_cast<std::uint64_t>(s)) : make(t_int, static_cast<std::uint64_t>(s));
  }

  // ---- containers ----
  value open_container(bool is_dict) {
    charge(sizeof(value) + (free_slots_.empty() ? sizeof(slot) : 0));
    std::uint64_t index = 0;
    if (!free_slots_.empty()) {
      index = free_slots_.back();
      free_slots_.pop_back();
    } else {
      index = slots_.size();
      slots_.emplace_back();
    }
    slots_[index].is_dict = is_dict;
    state_.push_back(make(t_open, index));
    return make(t_open, state_.size() - 1);
  }
  /// The slot of `v`, a list or dict still open (being filled), or null when
  /// it is not one (anything else, or an open one that was frozen since).
  slot* slot_of(value v) {
    if (tag_of(v) != t_open) return nullptr;
    const value st = state_[payload(v)];
    return tag_of(st) == t_open ? &slots_[payload(st)] : nullptr;
  }
  /// The frozen container with these items: an existing one with the same
  /// contents, or a new one.
  value intern_container(tag t, const value* first, std::size_t n) {
    if (n > std::numeric_limits<std::uint32_t>::max()) fail("a container of more than 2^32 items");
    std::uint64_t h = mix(t, n);
    for (std::size_t i = 0; i < n; ++i) h = mix(h, first[i]);
    if ((t_.containers_.size() + 1) * 2 > table_.size()) grow_table();
    const std::size_t mask = table_.size() - 1;
    for (std::size_t i = h & mask;; i = (i + 1) & mask) {
      const std::uint32_t id = table_[i];
      if (id == empty_entry) {
        const std::uint64_t new_id = t_.containers_.size();
        if (new_id >= empty_entry) fail("more than 2^32 distinct containers");
        charge(sizeof(tree::container) + sizeof(std::uint64_t) + 2 * sizeof(std::uint32_t) + n * sizeof(value));
        t_.containers_.push_back({t_.items_.size(), static_cast<std::uint32_t>(n), kind_of_tag(t)});
        t_.items_.insert(t_.items_.end(), first, first + n);
        hashes_.push_back(h);
        table_[i] = static_cast<std::uint32_t>(new_id);
        return make(t, new_id);
      }
      const tree::container& c = t_.containers_[id];
      if (hashes_[id] == h && c.count == n && c.k == kind_of_tag(t) &&
          std::equal(first, first + n, t_.items_.begin() + static_cast<std::ptrdiff_t>(c.offset)))
        return make(t, id);
    }
  }
  static kind kind_of_tag(tag t) noexcept { return t == t_list ? kind::list : t == t_dict ? kind::dict : kind::tuple; }
  void grow_table() {
    std::vector<std::uint32_t> bigger(std::max<std::size_t>(1024, table_.size() * 2), empty_entry);
    const std::size_t mask = bigger.size() - 1;
    for (std::size_t id = 0; id < t_.containers_.size(); ++id) {
      std::size_t i = hashes_[id] & mask;
      while (bigger[i] != empty_entry) i = (i + 1) & mask;
      bigger[i] = static_cast<std::uint32_t>(id);
    }
    table_.swap(bigger);
  }
  /// `v` as it is stored in a container: a list or dict made by this
  /// pickle is frozen the first time (a copy of it on the stack or in the
  /// memo then stands for the frozen one); anything else is itself.
  value freeze(value v) {
    if (tag_of(v) != t_open) return v;
    value& st = state_[payload(v)];
    if (tag_of(st) != t_open) return st;
    slot& s = slots_[payload(st)];
    const value frozen = intern_container(s.is_dict ? t_dict : t_list, s.items.data(), s.items.size());
    s.items.clear();
    if (s.items.capacity() > 4096) s.items.shrink_to_fit();
    free_slots_.push_back(payload(st));
    st = frozen;
    return frozen;
  }
  slot& target(value v, bool dict, const char* op) {
    if (slot* s = slot_of(v); s != nullptr && s->is_dict == dict) return *s;
    kind k = tree::kind_of(v);
    if (tag_of(v) == t_open) {
      const value st = state_[payload(v)];
      if (tag_of(st) != t_open && tree::kind_of(st) == (dict ? kind::dict : kind::list))
        fail(std::string(op) + " changes a " + (dict ? "dict" : "list") +
             " after it was put into another (a recursive structure)");
      k = tag_of(st) == t_open ? (slots_[payload(st)].is_dict ? kind::dict : kind::list) : tree::kind_of(st);
    }
    fail(std::string(op) + " on " + std::string(describe(k)) + ", not a " + (dict ? "dict" : "list"));
  }
  void append_from(std::size_t first, value container, const char* op) {
    // Freeze the items first: one of them may be the target itself.
    for (std::size_t i = first; i < stack_.size(); ++i) stack_[i] = freeze(stack_[i]);
    slot& s = target(container, false, op);
    s.items.insert(s.items.end(), stack_.begin() + static_cast<std::ptrdiff_t>(first), stack_.end());
    stack_.resize(first);
  }
  void setitems_from(std::size_t first, value container, const char* op) {
    if ((stack_.size() - first) % 2 != 0) fail(std::string(op) + " with an odd number of keys and values");
    for (std::size_t i = first; i < stack_.size(); ++i) stack_[i] = freeze(stack_[i]);
    slot& s = target(container, true, op);
    s.items.insert(s.items.end(), stack_.begin() + static_cast<std::ptrdiff_t>(first), stack_.end());
    stack_.resize(first);
  }
  value top() {
    if (stack_.size() <= floor()) fail("an opcode needs a value and the stack is empty");
    return stack_.back();
  }
  /// Memo entries are stored densely from 0 (pickle.dump numbers them in
  /// order); an entry beyond the dense end waits in `sparse_memo_` until the dense
  /// part reaches it, so an index far ahead costs one entry, not the gap.
  void memo_put(std::uint64_t index) {
    const value v = top();
    if (index > memo_end_ + 65536) fail("memo index " + std::to_string(index) + " far beyond the " +
                                        std::to_string(memo_end_) + " entries stored");
    memo_end_ = std::max(memo_end_, index + 1);
    if (index < memo_.size()) {
      memo_[index] = v;
      return;
    }
    if (index > memo_.size()) {
      if (sparse_memo_.insert_or_assign(index, v).second) charge(64);  // a hash node
      return;
    }
    charge(sizeof(value));
    memo_.push_back(v);
    // Entries stored ahead join the dense part as it reaches them.
    while (!sparse_memo_.empty()) {
      const auto it = sparse_memo_.find(memo_.size());
      if (it == sparse_memo_.end()) break;
      charge(sizeof(value));
      memo_.push_back(it->second);
      sparse_memo_.erase(it);
    }
  }
  void memo_get(std::uint64_t index) {
    value v = make(t_unset, 0);
    if (index < memo_.size()) {
      v = memo_[index];
    } else if (const auto it = sparse_memo_.find(index); it != sparse_memo_.end()) {
      v = it->second;
    }
    if (tag_of(v) == t_unset) fail("memo index " + std::to_string(index) + " was never stored");
    charge(sizeof(value));
    stack_.push_back(v);
  }
  /// A string or integer argument of `n` bytes: one longer than the pickle
  /// may be is refused before it is read.
  void check_length(std::uint64_t n, const char* what) const {
    if (n > lim_.max_bytes)
      throw limit_error(std::string(what) + " at byte " + std::to_string(op_at_) + " claims " + std::to_string(n) +
                            " bytes, more than the pickle's limit of " + std::to_string(lim_.max_bytes) + " bytes",
                        1);
  }
  void string_op(tag t, std::uint64_t n) {
    check_length(n, t == t_str ? "a string" : "a bytes object");
    take(n, scratch_);
    push(intern_string(t, scratch_));
  }
  value tuple_of(std::size_t first) {
    for (std::size_t i = first; i < stack_.size(); ++i) stack_[i] = freeze(stack_[i]);
    const value v = intern_container(t_tuple, stack_.data() + first, stack_.size() - first);
    stack_.resize(first);
    return v;
  }

  /// Runs one opcode; true at STOP.
  bool step(int op) {
    if (op == '.') {  // STOP
      if (!marks_.empty()) fail("STOP with a MARK still open");
      t_.root = freeze(pop());
      t_.bytes = offset();
      return true;
    }
    if (scalar_op(op) || stack_op(op) || container_op(op)) return false;
    refuse(op);
  }

  /// The opcodes that push one number or string (and PROTO, FRAME); true when `op` is one.
  bool scalar_op(int op) {
    switch (op) {
      case 0x80: {  // PROTO
        const int version = next();
        if (version < 0) fail("it ends inside an argument (truncated)");
        if (version > 5) fail("pickle protocol " + std::to_string(version) + " (this reader knows 2 to 5)");
        return true;
      }
      case 0x95: (void)le(8); return true;  // FRAME: a length hint only
      case 'N': push(make(t_none, 0)); return true;
      case 0x88: push(make(t_bool, 1)); return true;
      case 0x89: push(make(t_bool, 0)); return true;
      case 'K': push(make(t_int, le(1))); return true;
      case 'M': push(make(t_int, le(2))); return true;
      case 'J': push(from_int(static_cast<std::int32_t>(static_cast<std::uint32_t>(le(4))))); return true;
      case 0x8a: {  // LONG1
        take(le(1), scratch_);
        push(integer_le(scratch_));
        return true;
      }
      case 0x8b: {  // LONG4
        const auto n = static_cast<std::int32_t>(static_cast<std::uint32_t>(le(4)));
        if (n < 0) fail("LONG4 with a negative length");
        check_length(static_cast<std::uint64_t>(n), "an integer");
        take(static_cast<std::uint64_t>(n), scratch_);
        push(integer_le(scratch_));
        return true;
      }
      case 'G': {  // BINFLOAT: big-endian IEEE 754
        std::uint64_t bits = 0;
        for (int i = 0; i < 8; ++i) {
          const int b = next();
          if (b < 0) fail("it ends inside an argument (truncated)");
          bits = (bits << 8) | std::uint64_t(b);
        }
        double d = 0;
        std::memcpy(&d, &bits, sizeof d);
        charge(sizeof d);
        t_.floats_.push_back(d);
        push(make(t_float, t_.floats_.size() - 1));
        return true;
      }
      case 0x8c: string_op(t_str, le(1)); return true;    // SHORT_BINUNICODE
      case 'X': string_op(t_str, le(4)); return true;     // BINUNICODE
      case 0x8d: string_op(t_str, le(8)); return true;    // BINUNICODE8
      case 'U': string_op(t_str, le(1)); return true;     // SHORT_BINSTRING
      case 'T': string_op(t_str, le(4)); return true;     // BINSTRING
      case 'C': string_op(t_bytes, le(1)); return true;   // SHORT_BINBYTES
      case 'B': string_op(t_bytes, le(4)); return true;   // BINBYTES
      case 0x8e: string_op(t_bytes, le(8)); return true;  // BINBYTES8
      case 0x96: string_op(t_bytes, le(8)); return true;  // BYTEARRAY8
      default: return false;
    }
  }

  /// The opcodes that move values: MARK, POP, DUP and the memo; true when `op` is one.
  bool stack_op(int op) {
    switch (op) {
      case '(': marks_.push_back(stack_.size()); return true;  // MARK
      case 0x94: memo_put(memo_.size()); return true;     // MEMOIZE
      case 'q': memo_put(le(1)); return true;             // BINPUT
      case 'r': memo_put(le(4)); return true;             // LONG_BINPUT
      case 'h': memo_get(le(1)); return true;             // BINGET
      case 'j': memo_get(le(4)); return true;             // LONG_BINGET
      case '0': {  // POP: the top value, or the MARK above the stack
        if (stack_.size() > floor()) stack_.pop_back();
        else if (!marks_.empty()) marks_.pop_back();
        else fail("POP on an empty stack");
        return true;
      }
      case '1': stack_.resize(pop_mark()); return true;  // POP_MARK
      case '2': {                                           // DUP
        const value v = top();
        push(v);
        return true;
      }
      default: return false;
    }
  }

  /// The opcodes that build lists, dicts and tuples; true when `op` is one.
  bool container_op(int op) {
    switch (op) {
      case '}': push(open_container(true)); return true;       // EMPTY_DICT
      case ']': push(open_container(false)); return true;      // EMPTY_LIST
      case ')': push(intern_container(t_tuple, nullptr, 0)); return true;
      case 'a': {  // APPEND
        if (stack_.size() < floor() + 2) fail("APPEND without a list and a value");
        const std::size_t first = stack_.size() - 1;
        append_from(first, stack_[first - 1], "APPEND");
        return true;
      }
      case 'e': {  // APPENDS
        const std::size_t first = pop_mark();
        if (first <= floor()) fail("APPENDS without a list below its MARK");
        append_from(first, stack_[first - 1], "APPENDS");
        return true;
      }
      case 's': {  // SETITEM
        if (stack_.size() < floor() + 3) fail("SETITEM without a dict, a key and a value");
        const std::size_t first = stack_.size() - 2;
        setitems_from(first, stack_[first - 1], "SETITEM");
        return true;
      }
      case 'u': {  // SETITEMS
        const std::size_t first = pop_mark();
        if (first <= floor()) fail("SETITEMS without a dict below its MARK");
        setitems_from(first, stack_[first - 1], "SETITEMS");
        return true;
      }
      case 't': {  // TUPLE
        const std::size_t first = pop_mark();
        push(tuple_of(first));
        return true;
      }
      case 0x85: case 0x86: case 0x87: {  // TUPLE1..3
        const std::size_t n = static_cast<std::size_t>(op - 0x84);
        if (stack_.size() < floor() + n) fail("TUPLE" + std::to_string(n) + " with fewer values on the stack");
        push(tuple_of(stack_.size() - n));
        return true;
      }
      case 'l': case 'd': {  // LIST, DICT: from the items above the MARK
        const std::size_t first = pop_mark();
        const value c = open_container(op == 'd');
        stack_.insert(stack_.begin() + static_cast<std::ptrdiff_t>(first), c);
        count_object();
        if (op == 'd') setitems_from(first + 1, c, "DICT");
        else append_from(first + 1, c, "LIST");
        return true;
      }
      default: return false;
    }
  }

  /// An opcode this reader does not run: a reference to code (named), one
  /// a snapshot never holds, or no opcode at all.
  [[noreturn]] void refuse(int op) {
    switch (op) {
      case 'c': {  // GLOBAL: refused, naming what it refers to
        const std::string module = line();
        const std::string name = line();
        throw pickle_error("not a plain-data snapshot: it refers to " + module + "." + name +
                           " (pickle GLOBAL at byte " + std::to_string(op_at_) + "); nothing was run");
      }
      case 0x93: {  // STACK_GLOBAL
        std::string what = "a class or function";
        if (stack_.size() >= floor() + 2 && tag_of(stack_.back()) == t_str &&
            tag_of(stack_[stack_.size() - 2]) == t_str)
          what = t_.strings_[payload(stack_[stack_.size() - 2])] + "." + t_.strings_[payload(stack_.back())];
        throw pickle_error("not a plain-data snapshot: it refers to " + what + " (pickle STACK_GLOBAL at byte " +
                           std::to_string(op_at_) + "); nothing was run");
      }
      case 'R': case 'b': case 'i': case 'o': case 0x81: case 0x92: case 'P': case 'Q': case 0x82: case 0x83:
      case 0x84: case 0x8f: case 0x90: case 0x91: case 0x97: case 0x98: case 'I': case 'L': case 'F': case 'S':
      case 'V': case 'p': case 'g':
        unsupported(op);
      default: fail("byte " + hex_byte(op) + " is not a pickle opcode");
    }
  }

  static constexpr std::uint32_t empty_entry = std::numeric_limits<std::uint32_t>::max();

  const read_fn& in_;
  limits lim_;
  const std::function<void(std::uint64_t)>& on_bytes_;
  std::vector<char> buf_;
  std::size_t pos_ = 0, end_ = 0;
  std::uint64_t consumed_ = 0;  // bytes of the input before buf_
  std::uint64_t op_at_ = 0;
  std::uint64_t objects_ = 0;
  std::uint64_t memory_ = 0;  // bytes charged (charge)
  std::string scratch_;

  tree t_;
  std::vector<value> stack_;
  std::vector<std::size_t> marks_;
  std::vector<value> memo_;
  std::unordered_map<std::uint64_t, value> sparse_memo_;  // entries beyond memo_'s end
  std::uint64_t memo_end_ = 0;                            // 1 + the largest index stored
  std::vector<slot> slots_;     // the items of open lists and dicts
  std::vector<value> state_;    // per list or dict made: t_open and its slot, or what it froze into
  std::vector<std::uint64_t> free_slots_;
  std::unordered_map<std::string_view, std::uint64_t> string_ids_;
  std::vector<std::uint32_t> table_;      // open addressing: container ids by content hash
  std::vector<std::uint64_t> hashes_;     // per container id
};

tree read(const read_fn& in, const limits& lim, const std::function<void(std::uint64_t)>& on_bytes) {
  reader r(in, lim, on_bytes);
  return r.run();
}

}  // namespace ccalloc::pickle
