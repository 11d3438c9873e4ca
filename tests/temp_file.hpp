// temp_file.hpp: a file with given contents in the temporary directory,
// removed when the object goes away (tests that read files).
#pragma once

#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <system_error>
#include <unistd.h>

namespace ccalloc::testing {

class temp_file {
 public:
  /// Writes `contents` to TMP/ccalloc_test_<pid>_<name>.
  temp_file(std::string_view name, std::string_view contents)
      : path_(std::filesystem::temp_directory_path() /
              ("ccalloc_test_" + std::to_string(::getpid()) + "_" + std::string(name))) {
    std::ofstream out(path_, std::ios::binary);
    out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  }
  ~temp_file() {
    std::error_code ec;
    std::filesystem::remove(path_, ec);
  }
  temp_file(const temp_file&) = delete;
  temp_file& operator=(const temp_file&) = delete;
  [[nodiscard]] std::string path() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

}  // namespace ccalloc::testing
