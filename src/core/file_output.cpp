// Writing an output file whole, or not at all (include/ccalloc/core/file_output.hpp).
#include <ccalloc/core/file_output.hpp>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace ccalloc {

namespace {

constexpr std::string_view no_reader_step = ": a FIFO with no reader";

// Where a path leads: the file its links end at (`path`; the given path
// when it is no link), whether something is there, and whether it is
// written in place (not a regular file, or a path under /dev/ or /proc/:
// those name devices and open descriptors, whose links must not be
// followed by hand: /proc/self/fd/1 of a pipe reads as "pipe:[N]").
struct output_target {
  std::string path;
  bool exists = false;
  bool in_place = false;
  struct ::stat st {};
};

// 0, or the errno that stopped following the links (ELOOP past 40 links,
// as the kernel).
int resolve(const std::string& given, output_target& out) {
  if (given.starts_with("/dev/") || given.starts_with("/proc/")) {
    out.path = given;
    out.in_place = true;
    out.exists = ::stat(given.c_str(), &out.st) == 0;
    return 0;
  }
  std::string p = given;
  for (int links = 0;; ++links) {
    if (::lstat(p.c_str(), &out.st) != 0) {
      if (errno != ENOENT) return errno;
      out.path = p;  // nothing there yet (a dangling link's target included)
      return 0;
    }
    if (!S_ISLNK(out.st.st_mode)) {
      out.path = p;
      out.exists = true;
      out.in_place = !S_ISREG(out.st.st_mode);
      return 0;
    }
    if (links == 40) return ELOOP;
    std::error_code ec;
    const std::filesystem::path to = std::filesystem::read_symlink(p, ec);
    if (ec) return ec.value();
    p = to.is_absolute() ? to.string() : (std::filesystem::path(p).parent_path() / to).string();
  }
}

std::string folder_of(const std::string& path) {
  const std::string parent = std::filesystem::path(path).parent_path().string();
  return parent.empty() ? std::string(".") : parent;
}

// Writes all of `bytes` to `fd` (interrupted and short writes resumed);
// 0 or the errno.
int write_all(int fd, std::string_view bytes) {
  while (!bytes.empty()) {
    const ::ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EIO;
    bytes.remove_prefix(static_cast<std::size_t>(n));
  }
  return 0;
}

// Writes and closes `fd`; 0 or the errno of the first failed step.
int write_and_close(int fd, std::string_view bytes) {
  const int error = write_all(fd, bytes);
  const int closed = ::close(fd) == 0 ? 0 : errno;
  return error != 0 ? error : closed;
}

// A FIFO, device or descriptor path, written where it is. Opened without
// waiting for a FIFO's reader, then switched back to blocking writes (a
// reader slower than the writer is waited for; a missing one is not).
int write_in_place(const std::string& path, std::string_view bytes, std::string& step) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NONBLOCK, 0666);
  if (fd < 0) {
    const int error = errno;
    struct ::stat st {};
    if (error == ENXIO && ::stat(path.c_str(), &st) == 0 && S_ISFIFO(st.st_mode)) step = no_reader_step;
    return error;
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    const int error = errno;
    ::close(fd);
    return error;
  }
  return write_and_close(fd, bytes);
}

// The temporary files being written now (remove_temporary_files): a slot
// is free, being filled by its writer, published (its path may be removed),
// or taken by remove_temporary_files (its path is being removed; the slot
// is never reused). Lock-free atomics only, so that a signal handler may
// read them.
constexpr std::size_t temporary_slots = 16;
constexpr std::size_t temporary_path_bytes = 4096;
enum slot_state : int { slot_free, slot_filling, slot_published, slot_taken };
static_assert(std::atomic<int>::is_always_lock_free);
struct temporary_slot {
  std::atomic<int> state{slot_free};
  char path[temporary_path_bytes] = {};
};
temporary_slot temporary_table[temporary_slots];

// Publishes `path`; the slot's index, or temporary_slots when none is free
// or the path does not fit (the file is then not removed on a signal).
std::size_t publish_temporary(const std::string& path) noexcept {
  if (path.size() >= temporary_path_bytes) return temporary_slots;
  for (std::size_t i = 0; i < temporary_slots; ++i) {
    int expected = slot_free;
    if (!temporary_table[i].state.compare_exchange_strong(expected, slot_filling, std::memory_order_acquire))
      continue;
    path.copy(temporary_table[i].path, path.size());
    temporary_table[i].path[path.size()] = '\0';
    temporary_table[i].state.store(slot_published, std::memory_order_release);
    return i;
  }
  return temporary_slots;
}

// Withdraws a published path once its file is renamed or removed. A slot
// that remove_temporary_files took stays taken: it may still be reading
// the path.
void withdraw_temporary(std::size_t slot) noexcept {
  if (slot == temporary_slots) return;
  int expected = slot_published;
  (void)temporary_table[slot].state.compare_exchange_strong(expected, slot_free, std::memory_order_release);
}

}  // namespace

void remove_temporary_files() noexcept {
  for (temporary_slot& slot : temporary_table) {
    int expected = slot_published;
    if (slot.state.compare_exchange_strong(expected, slot_taken, std::memory_order_acquire))
      (void)::unlink(slot.path);
  }
}

int write_file_whole(const std::string& path, std::string_view bytes, std::string& step) {
  output_target target;
  if (const int error = resolve(path, target); error != 0) return error;
  if (target.in_place) return write_in_place(path, bytes, step);
  // A file there is replaced only where it could be written in place: a
  // read-only file stays.
  if (target.exists && ::access(target.path.c_str(), W_OK) != 0) return errno;
  // The temporary file is new and of a name no other writer uses (this
  // process's id and a count; created exclusively, never through a link),
  // so it cannot be a file of the user's, nor one that another thread or
  // process writing the same path is writing.
  const std::string folder = folder_of(target.path);
  static std::atomic<unsigned long> next_temporary{0};
  std::string temporary;
  int fd = -1;
  // The path is published before the file is created (a signal in between
  // removes nothing, or a file of this process's own name) and withdrawn
  // after it is renamed or removed.
  std::size_t slot = temporary_slots;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    temporary = target.path + ".tmp." + std::to_string(::getpid()) + "." +
                std::to_string(next_temporary.fetch_add(1, std::memory_order_relaxed));
    withdraw_temporary(slot);
    slot = publish_temporary(temporary);
    fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) {
    const int error = errno;
    withdraw_temporary(slot);
    step = ": cannot create a temporary file in " + folder;
    return error;
  }
  if (target.exists) (void)::fchmod(fd, target.st.st_mode & 07777);
  if (const int error = write_and_close(fd, bytes); error != 0) {
    ::unlink(temporary.c_str());
    withdraw_temporary(slot);
    step = ": cannot write a temporary file in " + folder;
    return error;
  }
  const int renamed = std::rename(temporary.c_str(), target.path.c_str()) == 0 ? 0 : errno;
  if (renamed != 0) ::unlink(temporary.c_str());
  withdraw_temporary(slot);
  return renamed;
}

int check_file_writable(const std::string& path, std::string& step) {
  output_target target;
  if (const int error = resolve(path, target); error != 0) return error;
  if (target.exists) {
    if (S_ISDIR(target.st.st_mode)) return EISDIR;
    if (::access(target.path.c_str(), W_OK) != 0) return errno;
    if (target.in_place) return 0;
  }
  const std::string folder = folder_of(target.path);
  struct ::stat st {};
  if (::stat(folder.c_str(), &st) != 0) return errno;
  if (!S_ISDIR(st.st_mode)) return ENOTDIR;
  if (::access(folder.c_str(), W_OK | X_OK) != 0) {
    const int error = errno;
    if (!target.in_place) step = ": cannot create a temporary file in " + folder;
    return error;
  }
  return 0;
}

}  // namespace ccalloc
