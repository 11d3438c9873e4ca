// errors_doc_test.cpp: keeps docs/errors.md honest. Every exception class of
// the public headers is described there, and every piece of literal text in
// a `throw` of src/ and include/ appears there (so a new or reworded message
// fails this test until the document quotes it). Messages assembled before
// the throw (config details, the out-of-memory text) are not seen by this
// scan; the document lists them by hand.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
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

// Every `throw <expression>;` in `src` with its string literals.
std::vector<throw_site> throw_sites(const std::string& file, const std::string& raw) {
  const std::string src = strip_comments(raw);
  std::vector<throw_site> sites;
  const std::regex keyword(R"((^|[^A-Za-z0-9_])throw([^A-Za-z0-9_;]))");
  for (auto it = std::sregex_iterator(src.begin(), src.end(), keyword); it != std::sregex_iterator(); ++it) {
    std::size_t i = static_cast<std::size_t>(it->position(0) + it->length(0)) - 1;
    throw_site site{file, static_cast<std::size_t>(std::count(src.begin(), src.begin() + it->position(0), '\n')) + 1, {}};
    int depth = 0;
    for (; i < src.size(); ++i) {
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

const fs::path source_dir{CCALLOC_SOURCE_DIR};

TEST(ErrorsDoc, DescribesEveryExceptionClass) {
  const std::string doc = read_file(source_dir / "docs" / "errors.md");
  ASSERT_FALSE(doc.empty()) << "docs/errors.md is missing";
  const std::regex derived(R"(class\s+(\w+)\s*(?:final\s*)?:\s*public\s+(?:ccalloc::)?(\w*error)\b)");
  std::size_t classes = 0;
  for (const auto& entry : fs::recursive_directory_iterator(source_dir / "include")) {
    if (entry.path().extension() != ".hpp") continue;
    const std::string text = strip_comments(read_file(entry.path()));
    for (auto it = std::sregex_iterator(text.begin(), text.end(), derived); it != std::sregex_iterator(); ++it) {
      ++classes;
      const std::string name = (*it)[1];
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

}  // namespace
