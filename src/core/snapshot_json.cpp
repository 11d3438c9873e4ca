// to_json and to_pickle(memory_snapshot): PyTorch's snapshot dictionary as
// JSON and as the pickle torch.cuda.memory._dump_snapshot writes
// (include/ccalloc/core/snapshot.hpp). Written by hand: the core depends on
// the standard library only, and the C API and the out-of-memory snapshot
// call this. One walk over the snapshot (write_snapshot) drives either
// writer; both have the same member functions.
#include <ccalloc/core/snapshot.hpp>

#include <bit>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace ccalloc {

namespace {

/// Length of the valid UTF-8 sequence (RFC 3629) that starts s[i], or 0 when
/// the bytes there are not one: a lone continuation byte, a truncated
/// sequence, an overlong encoding, a surrogate or a code point above U+10FFFF.
std::size_t utf8_sequence_length(std::string_view s, std::size_t i) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char lead = byte(i);
  if (lead < 0x80) return 1;
  std::size_t n = 0;
  unsigned char lo = 0x80, hi = 0xbf;  // range of the second byte
  if (lead >= 0xc2 && lead <= 0xdf) {
    n = 2;
  } else if (lead >= 0xe0 && lead <= 0xef) {
    n = 3;
    if (lead == 0xe0) lo = 0xa0;  // overlong below U+0800
    if (lead == 0xed) hi = 0x9f;  // UTF-16 surrogates
  } else if (lead >= 0xf0 && lead <= 0xf4) {
    n = 4;
    if (lead == 0xf0) lo = 0x90;  // overlong below U+10000
    if (lead == 0xf4) hi = 0x8f;  // above U+10FFFF
  } else {
    return 0;  // continuation byte, 0xc0/0xc1 (overlong) or 0xf5..0xff
  }
  if (s.size() - i < n) return 0;
  if (byte(i + 1) < lo || byte(i + 1) > hi) return 0;
  for (std::size_t k = 2; k < n; ++k)
    if (byte(i + k) < 0x80 || byte(i + k) > 0xbf) return 0;
  return n;
}

}  // namespace

std::string valid_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = utf8_sequence_length(s, i);
    if (n == 0) {
      out += "\xef\xbf\xbd";  // U+FFFD REPLACEMENT CHARACTER, for one byte
      ++i;
    } else {
      out.append(s.substr(i, n));
      i += n;
    }
  }
  return out;
}

namespace {

/// Appends JSON text to a string: objects and arrays with commas placed by a
/// "first item" flag per nesting level.
class json_writer {
 public:
  explicit json_writer(std::string& out) : out_(out) {}

  void begin_object() { open('{'); }
  void end_object() { close('}'); }
  void begin_array() { open('['); }
  void end_array() { close(']'); }
  /// A tuple in the pickle; an array in JSON.
  void begin_tuple() { begin_array(); }
  void end_tuple() { end_array(); }
  /// The key of the next value in the current object.
  void key(std::string_view k) {
    separate();
    string_literal(k);
    out_ += ':';
    after_key_ = true;
  }
  void value(std::string_view v) {
    separate();
    string_literal(v);
  }
  void value(const char* v) { value(std::string_view(v)); }
  void value(bool v) {
    separate();
    out_ += v ? "true" : "false";
  }
  void value(std::uint64_t v) {
    separate();
    out_ += std::to_string(v);
  }
  void value(std::int64_t v) {
    separate();
    out_ += std::to_string(v);
  }
  void value(int v) { value(static_cast<std::int64_t>(v)); }
  /// A finite double with enough digits to read back exactly.
  void value(double v) {
    separate();
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    out_ += buf;
    // JSON has no bare integers for floats in Python's reading: keep a '.'
    // so that json.loads gives a float, as PyTorch's pickle holds.
    const std::string_view written(buf);
    if (written.find_first_of(".eEn") == std::string_view::npos) out_ += ".0";
  }
  template <class K, class V>
  void member(K k, V v) {
    key(k);
    value(v);
  }

 private:
  void open(char c) {
    separate();
    out_ += c;
    first_.push_back(true);
  }
  void close(char c) {
    out_ += c;
    first_.pop_back();
  }
  void separate() {
    if (after_key_) {
      after_key_ = false;
      return;
    }
    if (first_.empty()) return;
    if (!first_.back()) out_ += ',';
    first_.back() = false;
  }
  void string_literal(std::string_view text) {
    out_ += '"';
    for (const char ch : valid_utf8(text)) {
      const auto c = static_cast<unsigned char>(ch);
      switch (c) {
        case '"': out_ += "\\\""; break;
        case '\\': out_ += "\\\\"; break;
        case '\n': out_ += "\\n"; break;
        case '\r': out_ += "\\r"; break;
        case '\t': out_ += "\\t"; break;
        case '\b': out_ += "\\b"; break;
        case '\f': out_ += "\\f"; break;
        default:
          if (c < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\u%04x", c);
            out_ += buf;
          } else {
            out_ += ch;  // valid UTF-8 (valid_utf8) passes through
          }
      }
    }
    out_ += '"';
  }

  std::string& out_;
  std::vector<bool> first_;
  bool after_key_ = false;
};

/// Appends a pickle (protocol 2, no memo) to a string: dictionaries, lists
/// and tuples as MARK ... SETITEMS / APPENDS / TUPLE, strings as BINUNICODE,
/// integers as BININT or LONG1, floats as BINFLOAT, booleans as NEWTRUE /
/// NEWFALSE. Python's pickle.load reads it as the objects PyTorch pickles.
class pickle_writer {
 public:
  explicit pickle_writer(std::string& out) : out_(out) { out_ += "\x80\x02"; }  // PROTO 2

  void begin_object() { out_ += "}("; }  // EMPTY_DICT MARK
  void end_object() { out_ += 'u'; }     // SETITEMS
  void begin_array() { out_ += "]("; }   // EMPTY_LIST MARK
  void end_array() { out_ += 'e'; }      // APPENDS
  void begin_tuple() { out_ += '('; }    // MARK
  void end_tuple() { out_ += 't'; }      // TUPLE
  void key(std::string_view k) { value(k); }
  void value(std::string_view text) {
    const std::string v = valid_utf8(text);  // pickle.load decodes BINUNICODE as strict UTF-8
    out_ += 'X';  // BINUNICODE: 4-byte little-endian length, UTF-8 bytes
    little_endian(static_cast<std::uint64_t>(v.size()), 4);
    out_ += v;
  }
  void value(const char* v) { value(std::string_view(v)); }
  void value(bool v) { out_ += v ? '\x88' : '\x89'; }
  void value(std::uint64_t v) {
    if (v <= 0x7fffffffu) return int32(static_cast<std::int64_t>(v));
    // LONG1: two's complement, little-endian, with a 0 byte when the top bit is set.
    const auto bytes = static_cast<std::size_t>((std::bit_width(v) + 8) / 8);
    out_ += '\x8a';
    out_ += static_cast<char>(bytes);
    little_endian(v, bytes);
  }
  void value(std::int64_t v) {
    if (v >= 0) return value(static_cast<std::uint64_t>(v));
    if (v >= -0x80000000LL) return int32(v);
    out_ += '\x8a';  // LONG1, 8 bytes of two's complement
    out_ += '\x08';
    little_endian(static_cast<std::uint64_t>(v), 8);
  }
  void value(int v) { value(static_cast<std::int64_t>(v)); }
  void value(double v) {
    out_ += 'G';  // BINFLOAT: IEEE 754, big-endian
    const auto bits = std::bit_cast<std::uint64_t>(v);
    for (int shift = 56; shift >= 0; shift -= 8) out_ += static_cast<char>((bits >> shift) & 0xff);
  }
  template <class K, class V>
  void member(K k, V v) {
    key(k);
    value(v);
  }
  void finish() { out_ += '.'; }  // STOP

 private:
  void int32(std::int64_t v) {
    out_ += 'J';  // BININT: 4-byte little-endian two's complement
    little_endian(static_cast<std::uint64_t>(v), 4);
  }
  void little_endian(std::uint64_t v, std::size_t bytes) {
    for (std::size_t i = 0; i < bytes; ++i) out_ += static_cast<char>(i < 8 ? (v >> (8 * i)) & 0xff : 0);
  }

  std::string& out_;
};

template <class W>
void write_frames(W& w, const context_ptr& context) {
  w.key("frames");
  w.begin_array();
  if (context) {
    for (const stack_frame& f : context->to_frames()) {
      w.begin_object();
      w.member("name", std::string_view(f.name));
      w.member("filename", std::string_view(f.filename));
      w.member("line", f.line);
      w.end_object();
    }
  }
  w.end_array();
}

template <class W>
void write_segment(W& w, const segment_info& s) {
  w.begin_object();
  w.member("device", s.device);
  w.member("address", std::uint64_t{s.address});
  w.member("total_size", std::uint64_t{s.total_bytes});
  w.member("allocated_size", std::uint64_t{s.allocated_bytes});
  w.member("active_size", std::uint64_t{s.active_bytes});
  w.member("requested_size", std::uint64_t{s.requested_bytes});
  w.member("stream", std::uint64_t{s.stream});
  w.member("segment_type", s.is_small_pool ? "small" : "large");
  w.key("segment_pool_id");
  w.begin_tuple();
  w.value(std::uint64_t{s.pool.first});
  w.value(std::uint64_t{s.pool.second});
  w.end_tuple();
  w.member("is_expandable", s.is_expandable);
  w.member("tag", std::string_view(s.tag));
  w.member("paused", s.paused);
  write_frames(w, s.context);
  w.key("blocks");
  w.begin_array();
  for (const block_info& b : s.blocks) {
    w.begin_object();
    w.member("address", std::uint64_t{b.address});
    w.member("size", std::uint64_t{b.size_bytes});
    w.member("requested_size", std::uint64_t{b.requested_bytes});
    w.member("state", to_string(b.state));
    w.member("tag", std::string_view(b.tag));
    write_frames(w, b.context);
    w.end_object();
  }
  w.end_array();
  w.end_object();
}

template <class W>
void write_entry(W& w, const trace_entry& e) {
  w.begin_object();
  w.member("action", to_string(e.action));
  w.member(e.action == trace_entry_action::oom ? "device_free" : "addr", std::uint64_t{e.addr});
  w.member("size", std::uint64_t{e.size});
  w.member("stream", std::uint64_t{e.stream});
  w.member("time_us", e.time_us);
  write_frames(w, e.context);
  w.member("compile_context", std::string_view(e.compile_context));
  w.member("user_metadata", std::string_view(e.user_metadata));
  w.member("tag", std::string_view(tag_name(e.tag)));
  w.end_object();
}

template <class W>
void write_settings(W& w, const allocator_config& c) {
  constexpr std::size_t unlimited = std::numeric_limits<std::size_t>::max();
  w.begin_object();
  // PyTorch's keys, in its order (PyTorch 2.11's snapshot).
  w.member("PYTORCH_CUDA_ALLOC_CONF", std::string_view(c.to_string()));
  w.member("max_split_size", c.max_split_size_bytes == unlimited
                                 ? std::int64_t{-1}
                                 : static_cast<std::int64_t>(c.max_split_size_bytes));
  w.member("garbage_collection_threshold", c.garbage_collection_threshold);
  w.member("expandable_segments", c.expandable_segments);
  w.member("pinned_num_register_threads", std::uint64_t{c.pinned_num_register_threads});
  w.member("release_lock_on_cudamalloc", c.release_lock_on_cudamalloc);
  w.member("pinned_use_cuda_host_register", c.pinned_use_cuda_host_register);
  w.member("graph_capture_record_stream_reuse", c.graph_capture_record_stream_reuse);
  w.key("roundup_power2_divisions");
  w.begin_object();
  for (std::size_t i = 0; i < c.roundup_power2_divisions.size(); ++i)
    w.member(std::to_string(std::uint64_t{1} << i), std::uint64_t{c.roundup_power2_divisions[i]});
  w.end_object();
  // ccalloc's own settings in force.
  w.member("large_segment_size", std::uint64_t{c.large_segment_size_bytes});
  w.member("max_non_split_rounding_size", std::uint64_t{c.max_non_split_rounding_bytes});
  w.member("per_process_memory_fraction", c.per_process_memory_fraction);
  w.member("trim_on_new_peak", c.trim_on_new_peak);
  w.end_object();
}

template <class W>
void write_snapshot(W& w, const memory_snapshot& snapshot) {
  w.begin_object();
  w.key("segments");
  w.begin_array();
  for (const segment_info& s : snapshot.segments) write_segment(w, s);
  w.end_array();
  w.key("device_traces");
  w.begin_array();
  for (const auto& trace : snapshot.device_traces) {
    w.begin_array();
    for (const trace_entry& e : trace) write_entry(w, e);
    w.end_array();
  }
  w.end_array();
  w.key("allocator_settings");
  write_settings(w, snapshot.config);
  w.key("external_annotations");
  w.begin_array();
  for (const annotation_entry& a : snapshot.external_annotations) {
    w.begin_object();
    w.member("device", a.device);
    w.member("time_us", a.time_us);
    for (const auto& [k, v] : a.metadata) w.member(std::string_view(k), std::string_view(v));
    w.end_object();
  }
  w.end_array();
  w.end_object();
}

}  // namespace

std::string to_json(const memory_snapshot& snapshot) {
  std::string out;
  out.reserve(256 + snapshot.segments.size() * 512);
  json_writer w(out);
  write_snapshot(w, snapshot);
  return out;
}

std::string to_pickle(const memory_snapshot& snapshot) {
  std::string out;
  out.reserve(256 + snapshot.segments.size() * 512);
  pickle_writer w(out);
  write_snapshot(w, snapshot);
  w.finish();
  return out;
}

}  // namespace ccalloc
