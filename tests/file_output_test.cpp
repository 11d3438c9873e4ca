// file_output_test.cpp: output files written whole or not at all
// (write_file_whole, check_file_writable; include/ccalloc/core/file_output.hpp).
#include <ccalloc/core/file_output.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <unistd.h>

namespace {

namespace fs = std::filesystem;

/// A fresh, empty folder under the test's temporary directory.
fs::path fresh_dir(const std::string& name) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("ccalloc-file-output-" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// write_file_whole of 100,000 bytes to `path` under a file size limit of
// 4 KiB, with `handler` (SIG_IGN, or a function) for the SIGXFSZ the write
// raises part way; its result, or nothing where the limit cannot be set.
std::optional<int> write_past_a_size_limit(const fs::path& path, void (*handler)(int), std::string& step) {
  struct ::rlimit saved {};
  if (::getrlimit(RLIMIT_FSIZE, &saved) != 0) return std::nullopt;
  if (saved.rlim_max != RLIM_INFINITY && saved.rlim_max < 4096) return std::nullopt;
  const auto old_handler = std::signal(SIGXFSZ, handler);
  struct ::rlimit limit = saved;
  limit.rlim_cur = 4096;
  if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) {
    std::signal(SIGXFSZ, old_handler);
    return std::nullopt;
  }
  const int error = ccalloc::write_file_whole(path.string(), std::string(100000, 'x'), step);
  ::setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, old_handler);
  return error;
}

// A file size limit stops the write part way (EFBIG, SIGXFSZ ignored): the
// old file stays whole with its mode, and no temporary file is left.
TEST(FileOutput, AWriteCutOffPartWayLeavesTheOldFileWhole) {
  const fs::path dir = fresh_dir("cut-off");
  const fs::path path = dir / "keep.html";
  std::ofstream(path) << "old";
  fs::permissions(path, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  std::string step;
  const std::optional<int> error = write_past_a_size_limit(path, SIG_IGN, step);
  if (!error) GTEST_SKIP() << "file size limit below 4 KiB";
  EXPECT_EQ(*error, EFBIG);
  EXPECT_EQ(step, ": cannot write a temporary file in " + dir.string());
  EXPECT_EQ(read_file(path), "old");
  EXPECT_EQ(fs::status(path).permissions(), fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  EXPECT_EQ(names_in(dir), std::vector<std::string>{"keep.html"});
}

// The folder remove_temporary_files_in_handler looks in (an open
// descriptor), and the temporary files (names holding ".tmp.") it found
// there before and after its call; -1: not called.
int signal_dir_fd = -1;
int temporaries_before_removal = -1, temporaries_after_removal = -1;

// Temporary files in signal_dir_fd, with system calls only (no allocation:
// it runs in a signal handler); -1 when the folder cannot be read.
int count_temporaries() {
  if (::lseek(signal_dir_fd, 0, SEEK_SET) != 0) return -1;
  alignas(8) static char buffer[8192];
  int count = 0;
  for (;;) {
    const long n = ::syscall(SYS_getdents64, signal_dir_fd, buffer, sizeof buffer);
    if (n < 0) return -1;
    if (n == 0) return count;
    for (long at = 0; at < n;) {
      unsigned short length = 0;
      std::memcpy(&length, buffer + at + 16, sizeof length);  // struct linux_dirent64: d_reclen at 16, d_name at 19
      if (std::strstr(buffer + at + 19, ".tmp.") != nullptr) ++count;
      at += length;
    }
  }
}

// A handler of the signal a write raises part way (SIGXFSZ, at a file size
// limit) standing for a program's SIGTERM handler: it removes the
// temporary files of the writes in progress, counting them before and
// after.
extern "C" void remove_temporary_files_in_handler(int) {
  temporaries_before_removal = count_temporaries();
  ccalloc::remove_temporary_files();
  temporaries_after_removal = count_temporaries();
}

// remove_temporary_files, called from a signal handler while a write is in
// progress (after 40 earlier writes: more than its table's 16 slots, so
// each write's slot was given back), removes that write's temporary file;
// the write then fails and the old file stays.
TEST(FileOutput, RemoveTemporaryFilesFromASignalHandlerRemovesTheWriteInProgress) {
  const fs::path dir = fresh_dir("signal");
  const fs::path path = dir / "keep.html";
  signal_dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  ASSERT_GE(signal_dir_fd, 0);
  std::string step;
  for (int i = 0; i < 40; ++i) ASSERT_EQ(ccalloc::write_file_whole(path.string(), "old", step), 0);
  const std::optional<int> error = write_past_a_size_limit(path, remove_temporary_files_in_handler, step);
  ::close(signal_dir_fd);
  if (!error) GTEST_SKIP() << "file size limit below 4 KiB";
  EXPECT_EQ(*error, EFBIG);
  EXPECT_EQ(temporaries_before_removal, 1);
  EXPECT_EQ(temporaries_after_removal, 0);
  EXPECT_EQ(read_file(path), "old");
  // With no write in progress, nothing is removed (not even a file of a
  // temporary file's name that no write of this process made).
  std::ofstream(dir / "keep.html.tmp.1.1") << "stale";
  ccalloc::remove_temporary_files();
  EXPECT_EQ(names_in(dir), (std::vector<std::string>{"keep.html", "keep.html.tmp.1.1"}));
}

// A dangling symbolic link: the check creates nothing; the write creates
// the file it leads to and leaves the link; a failed write (its folder
// gone) leaves the link and creates nothing.
TEST(FileOutput, ADanglingLinkStaysAndItsTargetAppearsOnlyWhenWritten) {
  const fs::path dir = fresh_dir("dangling");
  fs::create_directories(dir / "x");
  const fs::path link = dir / "out.json";
  fs::create_symlink(dir / "x" / "target.json", link);
  std::string step;
  EXPECT_EQ(ccalloc::check_file_writable(link.string(), step), 0);
  EXPECT_TRUE(names_in(dir / "x").empty());
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(link)));
  EXPECT_EQ(ccalloc::write_file_whole(link.string(), "{}", step), 0);
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(link)));
  EXPECT_EQ(read_file(dir / "x" / "target.json"), "{}");
  EXPECT_EQ(names_in(dir / "x"), std::vector<std::string>{"target.json"});
  // A relative link to a folder that is not there.
  const fs::path nowhere = dir / "nowhere.json";
  fs::create_symlink("missing/target.json", nowhere);
  EXPECT_EQ(ccalloc::check_file_writable(nowhere.string(), step), ENOENT);
  EXPECT_EQ(ccalloc::write_file_whole(nowhere.string(), "{}", step), ENOENT);
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(nowhere)));
  EXPECT_EQ(names_in(dir), (std::vector<std::string>{"nowhere.json", "out.json", "x"}));
}

// The check opens nothing: a FIFO (a reader would see end-of-file) passes
// it when writable; the write refuses it at once without a reader.
TEST(FileOutput, AFifoIsCheckedWithoutOpeningAndNotWaitedFor) {
  const fs::path dir = fresh_dir("fifo");
  const fs::path fifo = dir / "f";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::string step;
  EXPECT_EQ(ccalloc::check_file_writable(fifo.string(), step), 0);
  EXPECT_EQ(ccalloc::write_file_whole(fifo.string(), "{}", step), ENXIO);
  EXPECT_EQ(step, ": a FIFO with no reader");
  EXPECT_EQ(names_in(dir), std::vector<std::string>{"f"});
}

// A folder, or a path in a missing folder, fails the check as the write.
TEST(FileOutput, TheCheckFailsWhereTheWriteWould) {
  const fs::path dir = fresh_dir("check");
  std::string step;
  EXPECT_EQ(ccalloc::check_file_writable(dir.string(), step), EISDIR);
  EXPECT_EQ(ccalloc::write_file_whole(dir.string(), "{}", step), EISDIR);
  EXPECT_EQ(ccalloc::check_file_writable((dir / "no" / "f").string(), step), ENOENT);
  EXPECT_EQ(ccalloc::write_file_whole((dir / "no" / "f").string(), "{}", step), ENOENT);
  EXPECT_TRUE(names_in(dir).empty());
}

}  // namespace
