// The lease of an exported range (see ipc_lease.hpp).
#include "ipc_lease.hpp"

#include <ccalloc/base/errors.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>

namespace ccalloc::detail {

namespace {
constexpr std::uint64_t lease_magic = 0x3165736165'4c6363ull;  // "ccLease1", little-endian
}  // namespace

struct ipc_lease::file {
  struct slot {
    std::atomic<std::uint32_t> pid;     // 0: free
    std::uint32_t reserved;
    std::atomic<std::uint64_t> start;   // the holder's start ticks; 0 while it is being claimed
  };
  std::uint64_t magic;
  std::atomic<std::uint32_t> revoked;
  std::uint32_t slots_in_file;
  slot slots[slot_count];
};
static_assert(sizeof(std::atomic<std::uint64_t>) == 8 && std::atomic<std::uint64_t>::is_always_lock_free,
              "the lease needs lock-free 64-bit atomics in shared memory");
static_assert(sizeof(std::atomic<std::uint32_t>) == 4 && std::atomic<std::uint32_t>::is_always_lock_free);

std::uint64_t process_start_ticks(std::uint32_t pid) noexcept {
  char path[48];
  std::snprintf(path, sizeof path, "/proc/%u/stat", static_cast<unsigned>(pid));
  std::FILE* f = std::fopen(path, "re");
  if (f == nullptr) return 0;
  char buf[1024];
  const std::size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  // "pid (comm) state ...": comm may hold spaces and parentheses; the state
  // follows the last ')'.
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr || p[1] != ' ') return 0;
  p += 2;
  if (*p == 'Z' || *p == 'X' || *p == 'x') return 0;  // ended, not yet reaped
  // The state is field 3; starttime is field 22: 19 more fields on.
  for (int field = 3; field < 22; ++field) {
    p = std::strchr(p, ' ');
    if (p == nullptr) return 0;
    ++p;
  }
  return std::strtoull(p, nullptr, 10);
}

ipc_lease::ipc_lease(ipc_lease&& other) noexcept
    : file_(std::exchange(other.file_, nullptr)), fd_(std::exchange(other.fd_, -1)) {}

ipc_lease& ipc_lease::operator=(ipc_lease&& other) noexcept {
  if (this != &other) {
    ipc_lease old(std::move(*this));
    file_ = std::exchange(other.file_, nullptr);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

ipc_lease::~ipc_lease() {
  if (file_ != nullptr) ::munmap(file_, file_bytes);
  if (fd_ >= 0) ::close(fd_);
}

ipc_lease ipc_lease::create() {
  static_assert(sizeof(file) <= file_bytes);
  ipc_lease l;
  l.fd_ = ::memfd_create("ccalloc-ipc-lease", MFD_CLOEXEC);
  if (l.fd_ < 0) throw backend_error(std::string("ccalloc: ipc lease: memfd_create failed: ") + std::strerror(errno));
  if (::ftruncate(l.fd_, file_bytes) != 0)
    throw backend_error(std::string("ccalloc: ipc lease: ftruncate failed: ") + std::strerror(errno));
  void* p = ::mmap(nullptr, file_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, l.fd_, 0);
  if (p == MAP_FAILED) throw backend_error(std::string("ccalloc: ipc lease: mmap failed: ") + std::strerror(errno));
  l.file_ = static_cast<file*>(p);  // zero-filled: no slot held, not revoked
  l.file_->slots_in_file = slot_count;
  std::atomic_ref<std::uint64_t>(l.file_->magic).store(lease_magic, std::memory_order_release);
  return l;
}

ipc_lease ipc_lease::open(int fd) {
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || static_cast<std::size_t>(st.st_size) != file_bytes)
    throw backend_error("ccalloc: open_ipc_handle: descriptor " + std::to_string(fd) +
                        " is not an ipc lease file (expected a " + std::to_string(file_bytes) + "-byte memory file)");
  void* p = ::mmap(nullptr, file_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED)
    throw backend_error(std::string("ccalloc: open_ipc_handle: mmap of the lease failed: ") + std::strerror(errno));
  ipc_lease l;
  l.file_ = static_cast<file*>(p);
  if (std::atomic_ref<std::uint64_t>(l.file_->magic).load(std::memory_order_acquire) != lease_magic ||
      l.file_->slots_in_file != slot_count)
    throw backend_error("ccalloc: open_ipc_handle: descriptor " + std::to_string(fd) +
                        " is not an ipc lease file (bad magic or slot count)");
  return l;
}

std::size_t ipc_lease::acquire() {
  const auto me = static_cast<std::uint32_t>(::getpid());
  const std::uint64_t start = process_start_ticks(me);
  for (std::size_t i = 0; i < slot_count; ++i) {
    file::slot& s = file_->slots[i];
    std::uint32_t expected = 0;
    if (!s.pid.compare_exchange_strong(expected, me)) continue;
    s.start.store(start);
    if (file_->revoked.load() != 0) {
      release(i);
      throw backend_error(
          "ccalloc: open_ipc_handle: the producer has freed the block since it shared the handle (the export "
          "is revoked); share it again from a live block");
    }
    return i;
  }
  throw backend_error("ccalloc: open_ipc_handle: all " + std::to_string(slot_count) +
                      " importer slots of the export are held (processes that have the range open)");
}

void ipc_lease::release(std::size_t slot) noexcept {
  file::slot& s = file_->slots[slot];
  s.start.store(0);
  s.pid.store(0);
}

void ipc_lease::revoke() noexcept { file_->revoked.store(1); }

std::size_t ipc_lease::holders(std::size_t* dead) noexcept {
  std::size_t live = 0;
  std::size_t ended = 0;
  for (file::slot& s : file_->slots) {
    const std::uint32_t pid = s.pid.load();
    if (pid == 0) continue;
    const std::uint64_t start = s.start.load();
    const std::uint64_t now = process_start_ticks(pid);
    // start 0: claimed a moment ago (or the claimer died mid-claim: then
    // only the pid's existence is known).
    if (now != 0 && (start == 0 || start == now)) {
      ++live;
      continue;
    }
    // Ended: clear the slot, unless it changed hands meanwhile.
    std::uint32_t expected = pid;
    if (s.start.load() == start && s.pid.compare_exchange_strong(expected, 0)) {
      s.start.store(0);
      ++ended;
    } else {
      ++live;  // taken again since the load: count it, the next look sees who
    }
  }
  if (dead != nullptr) *dead = ended;
  return live;
}

}  // namespace ccalloc::detail
