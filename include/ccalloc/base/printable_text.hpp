// ccalloc/base/printable_text.hpp: text from input made safe to print.
//
// Every layer that quotes its input in a message (the configuration parser,
// the trace readers, the CLI) escapes it with printable_text, so that input
// cannot clear a terminal or cut a C string short.
#pragma once

#include <string>
#include <string_view>

namespace ccalloc {

/// `text` safe to print on a terminal and to carry in a C string: each
/// control byte (below 0x20 except tab and newline, and 0x7f; NUL and ESC
/// included) becomes "\xHH", so input cannot clear the screen or cut a
/// message short. Other bytes (UTF-8 included) stay as they are.
/// Pure function; allocates the returned string (may throw std::bad_alloc).
inline std::string printable_text(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if ((u < 0x20 && c != '\n' && c != '\t') || u == 0x7f) {
      constexpr char hex[] = "0123456789abcdef";
      out += "\\x";
      out += hex[u >> 4];
      out += hex[u & 0xf];
    } else {
      out += c;
    }
  }
  return out;
}

/// printable_text on one line: newline and tab written as "\n" and "\t"
/// too, so that quoted input (a configuration value, a file name) cannot
/// make a message look like two. Pure function; may throw std::bad_alloc.
inline std::string printable_line(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else out += c;
  }
  return printable_text(out);
}

}  // namespace ccalloc
