// errors_doc_test.cpp: keeps docs/errors.md honest. Every exception class of
// the public headers is described there, and every piece of literal text in
// a `throw` of src/ and include/ appears there (so a new or reworded message
// fails this test until the document quotes it). Messages assembled before
// the throw (config details, the out-of-memory text) are not seen by this
// scan; the document lists them by hand.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace {

namespace fs = std::filesystem;

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

// C++ source with comments blanked out (string and character literals kept).
std::string strip_comments(const std::string& src) {
  std::string out = src;
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (out[i] == '"' || out[i] == '\'') {  // skip the literal
      const char quote = out[i];
      for (++i; i < out.size() && out[i] != quote; ++i)
        if (out[i] == '\\') ++i;
    } else if (out.compare(i, 2, "//") == 0) {
      while (i < out.size() && out[i] != '\n') out[i++] = ' ';
    } else if (out.compare(i, 2, "/*") == 0) {
      const std::size_t end = out.find("*/", i + 2);
      const std::size_t stop = end == std::string::npos ? out.size() : end + 2;
      for (; i < stop; ++i)
        if (out[i] != '\n') out[i] = ' ';
    }
  }
  return out;
}

struct throw_site {
  std::string file;
  std::size_t line;
  std::vector<std::string> literals;  // the string literals of the thrown expression
};

bool is_identifier_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_'; }

// Every `throw <expression>;` in `raw` with its string literals. (A hand-made
// scan: <regex> trips a false -Wmaybe-uninitialized of GCC 12 under the
// sanitizers.)
std::vector<throw_site> throw_sites(const std::string& file, const std::string& raw) {
  const std::string src = strip_comments(raw);
  std::vector<throw_site> sites;
  for (std::size_t at = src.find("throw"); at != std::string::npos; at = src.find("throw", at + 5)) {
    const std::size_t after = at + 5;
    if ((at > 0 && is_identifier_char(src[at - 1])) || after >= src.size() || is_identifier_char(src[after]))
      continue;  // part of a longer name (throw_out_of_memory)
    throw_site site{file, static_cast<std::size_t>(std::count(src.begin(), src.begin() + static_cast<std::ptrdiff_t>(at), '\n')) + 1, {}};
    int depth = 0;
    for (std::size_t i = after; i < src.size(); ++i) {
      const char c = src[i];
      if (c == '"') {
        std::string literal;
        for (++i; i < src.size() && src[i] != '"'; ++i) {
          if (src[i] == '\\' && i + 1 < src.size()) ++i;
          literal += src[i];
        }
        site.literals.push_back(literal);
      } else if (c == '\'') {
        for (++i; i < src.size() && src[i] != '\''; ++i)
          if (src[i] == '\\') ++i;
      } else if (c == '(' || c == '{' || c == '[') {
        ++depth;
      } else if (c == ')' || c == '}' || c == ']') {
        --depth;
      } else if (c == ';' && depth <= 0) {
        break;
      }
    }
    sites.push_back(std::move(site));
  }
  return sites;
}

// Names of the classes in `text` declared as "class NAME [final] : public
// [ccalloc::]SOMETHING_error" (or ": public error").
std::vector<std::string> exception_classes(const std::string& text) {
  std::vector<std::string> names;
  for (std::size_t at = text.find("class "); at != std::string::npos; at = text.find("class ", at + 6)) {
    if (at > 0 && is_identifier_char(text[at - 1])) continue;
    std::size_t i = at + 6;
    const std::size_t name_begin = i;
    while (i < text.size() && is_identifier_char(text[i])) ++i;
    const std::string name = text.substr(name_begin, i - name_begin);
    const std::size_t colon = text.find_first_of(":;{", i);
    if (colon == std::string::npos || text[colon] != ':') continue;  // a declaration or no base
    std::size_t base_begin = text.find_first_not_of(" \t\n", colon + 1);
    if (text.compare(base_begin, 7, "public ") != 0) continue;
    base_begin = text.find_first_not_of(" \t\n", base_begin + 7);
    std::size_t base_end = base_begin;
    while (base_end < text.size() && (is_identifier_char(text[base_end]) || text[base_end] == ':')) ++base_end;
    const std::string base = text.substr(base_begin, base_end - base_begin);
    if (base.size() >= 5 && base.compare(base.size() - 5, 5, "error") == 0 && base.find("std::") != 0)
      names.push_back(name);
  }
  return names;
}

const fs::path source_dir{CCALLOC_SOURCE_DIR};

TEST(ErrorsDoc, DescribesEveryExceptionClass) {
  const std::string doc = read_file(source_dir / "docs" / "errors.md");
  ASSERT_FALSE(doc.empty()) << "docs/errors.md is missing";
  std::size_t classes = 0;
  for (const auto& entry : fs::recursive_directory_iterator(source_dir / "include")) {
    if (entry.path().extension() != ".hpp") continue;
    for (const std::string& name : exception_classes(strip_comments(read_file(entry.path())))) {
      ++classes;
      EXPECT_NE(doc.find("`" + name + "`"), std::string::npos)
          << entry.path().string() << " declares " << name << ", which docs/errors.md does not describe";
    }
  }
  EXPECT_GE(classes, 5u) << "the scan found too few exception classes: is the regex still right?";
}

TEST(ErrorsDoc, QuotesTheLiteralTextOfEveryThrow) {
  const std::string doc = read_file(source_dir / "docs" / "errors.md");
  std::size_t sites = 0, literals = 0;
  for (const char* dir : {"src", "include"}) {
    for (const auto& entry : fs::recursive_directory_iterator(source_dir / dir)) {
      const auto ext = entry.path().extension();
      if (ext != ".cpp" && ext != ".hpp") continue;
      const std::string rel = fs::relative(entry.path(), source_dir).string();
      for (const throw_site& site : throw_sites(rel, read_file(entry.path()))) {
        ++sites;
        for (const std::string& literal : site.literals) {
          if (std::count_if(literal.begin(), literal.end(), [](char c) { return c != ' '; }) < 3) continue;
          ++literals;
          EXPECT_NE(doc.find(literal), std::string::npos)
              << site.file << ":" << site.line << " throws a message with \"" << literal
              << "\", which docs/errors.md does not quote";
        }
      }
    }
  }
  std::printf("%zu throw sites, %zu literals checked\n", sites, literals);
  EXPECT_GE(sites, 40u) << "the scan found too few throw sites: is the parser still right?";
  EXPECT_GE(literals, 60u);
}

// The out-of-memory message is assembled at run time: provoke each kind of
// advice and check that docs/errors.md quotes it (each suggested setting, or
// the whole advice sentence), and that no advice names a setting that would
// not change the outcome in that configuration (issue 16, item 5).
// `request_mib`: the request that fails. Fragmented, 40 MiB needs more than
// the device's free memory and all the cache together (returning the cache
// would not help); 36 MiB does not.
std::string oom_advice(const std::string& config, bool fragment, const char* fraction = nullptr,
                       std::size_t request_mib = 40) {
  ccalloc::sim_options o;
  o.capacity_bytes = 64 * ccalloc::mib;
  auto sim = std::make_shared<ccalloc::sim_backend>(o);
  ccalloc::caching_allocator a(sim, ccalloc::allocator_config::parse(config));
  a.init(1);
  if (fraction != nullptr) a.set_memory_fraction(std::stod(fraction), 0);
  std::vector<void*> live;
  if (fragment) {  // small live blocks spread over pages and segments, half of them freed
    // 64 KiB short of a page: packed across page boundaries (at most 1/64 of
    // a page short, they would be carved on page boundaries and free whole pages)
    for (int i = 0; i < 24; ++i) live.push_back(a.malloc(0, 2 * ccalloc::mib - 64 * 1024, 0));
    for (std::size_t i = 0; i < live.size(); i += 2) a.free(std::exchange(live[i], nullptr));
  } else {  // one live block: nothing cached, 40 MiB more does not fit (36 neither)
    live.push_back(a.malloc(0, 30 * ccalloc::mib, 0));
  }
  std::string msg;
  try {
    (void)a.malloc(0, request_mib * ccalloc::mib, 0);
  } catch (const ccalloc::out_of_memory_error& e) {
    msg = e.what();
  }
  for (void* p : live)
    if (p != nullptr) a.free(p);
  const std::size_t at = msg.find("the largest cached free block is ");
  if (at == std::string::npos) return "no out-of-memory message: " + msg;
  return msg.substr(msg.find(". ", at) + 1);  // from the space before the advice
}

TEST(ErrorsDoc, QuotesEveryOutOfMemoryAdvice) {
  const std::string doc = read_file(source_dir / "docs" / "errors.md");
  struct oom_case {
    const char* config;
    bool fragment;
    const char* fraction;
    std::vector<std::string> must, must_not;
    std::size_t request_mib = 36;
  };
  const std::vector<oom_case> cases = {
      {"expandable_segments:False", true, nullptr,
       {"expandable_segments:True", "max_split_size_mb:<MiB>"}, {"garbage_collection_threshold"}},
      {"expandable_segments:False,max_split_size_mb:40", true, nullptr,
       {"expandable_segments:True"}, {"max_split_size_mb", "garbage_collection_threshold"}},
      {"expandable_segments:True", true, nullptr, {"pages shared with live blocks"},
       {"max_split_size_mb", "garbage_collection_threshold", "memory fraction"}},
      {"expandable_segments:True", false, nullptr, {"Reduce the memory"}, {"memory fraction", "CCALLOC_CONF"}},
      {"expandable_segments:True", false, "0.75", {"raise the memory fraction"}, {"CCALLOC_CONF"}},
      {"expandable_segments:False", true, nullptr, {"Returning the cache would not make room"},
       {"CCALLOC_CONF", "memory fraction"}, 40},
  };
  for (const oom_case& c : cases) {
    const std::string advice = oom_advice(c.config, c.fragment, c.fraction, c.request_mib);
    SCOPED_TRACE(std::string(c.config) + (c.fragment ? ", fragmented" : "") + ": " + advice);
    for (const std::string& m : c.must) EXPECT_NE(advice.find(m), std::string::npos) << m;
    for (const std::string& m : c.must_not) EXPECT_EQ(advice.find(m), std::string::npos) << m;
    // docs/errors.md quotes it: each setting's text, or the sentence.
    const std::size_t conf = advice.find("CCALLOC_CONF=");
    if (conf == std::string::npos) {
      std::string sentence = advice;
      if (c.fraction != nullptr) sentence = sentence.substr(0, sentence.find(", or raise"));
      EXPECT_NE(doc.find(sentence), std::string::npos) << "docs/errors.md does not quote the advice";
    } else {
      std::string rest = advice.substr(conf + 13);
      rest.pop_back();  // the final '.'
      for (std::size_t from = 0; from <= rest.size();) {
        const std::size_t to = std::min(rest.find(", or ", from), rest.size());
        const std::string setting = rest.substr(from, to - from);
        EXPECT_NE(doc.find(setting), std::string::npos) << "docs/errors.md does not quote '" << setting << "'";
        from = to + 5;
      }
    }
  }
}

}  // namespace
