// IPC handles that carry the exporter's descriptor numbers instead of the
// descriptors (share_ipc_handle_pidfd / open_ipc_handle_pidfd): the importer
// takes them with pidfd_getfd. See caching_allocator.hpp for the layout.
#include "ipc_export.hpp"

#include <ccalloc/base/detail/pointer_text.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>
#include <ccalloc/frontend/ipc_handle.hpp>

#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

namespace ccalloc {

namespace {

constexpr std::string_view pidfd_magic = "ccIPCpfd";
constexpr std::size_t pidfd_entry_bytes = 12;  // i32 descriptor, u64 inode

template <class T>
void put(std::string& out, T value) {
  for (std::size_t i = 0; i < sizeof(T); ++i)
    out.push_back(static_cast<char>((static_cast<std::uint64_t>(value) >> (8 * i)) & 0xff));
}
template <class T>
T get(std::string_view in, std::size_t at) {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i)
    v |= static_cast<std::uint64_t>(static_cast<unsigned char>(in[at + i])) << (8 * i);
  return static_cast<T>(v);
}

std::uint64_t inode_of(int fd) {
  struct ::stat st {};
  return ::fstat(fd, &st) == 0 ? static_cast<std::uint64_t>(st.st_ino) : 0;
}

[[noreturn]] void fail_call(const std::string& what, int err) {
  throw backend_error("ccalloc: open_ipc_handle_pidfd: " + what + " failed: " + std::strerror(err) +
                      (err == EPERM ? " (taking another process's descriptors needs ptrace permission over it: "
                                      "the same user; under Yama ptrace_scope 1 the exporter must be a descendant "
                                      "or allow it with prctl(PR_SET_PTRACER))"
                                    : ""));
}

}  // namespace

std::string caching_allocator::share_ipc_handle_pidfd(void* ptr) {
  ipc_export ex = share_ipc_handle(ptr);
  for (int fd : ex.fds) ::close(fd);  // duplicates: the registry keeps the export's own
  std::vector<int> own;
  if (!ex.fds.empty()) {
    std::lock_guard lock(exports_->mutex);
    auto it = exports_->entries.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (it == exports_->entries.end())
      throw invalid_argument_error("ccalloc: share_ipc_handle_pidfd(" + detail::pointer_text(ptr) +
                                   "): the block was freed while it was being shared");
    own = it->second.fds;
  }
  std::string out(pidfd_magic);
  put<std::uint32_t>(out, static_cast<std::uint32_t>(own.size()));
  for (int fd : own) {
    put<std::int32_t>(out, fd);
    put<std::uint64_t>(out, inode_of(fd));
  }
  out += ex.handle;
  return out;
}

void* caching_allocator::open_ipc_handle_pidfd(std::string_view bytes, int access_device) {
  const std::size_t head = pidfd_magic.size() + 4;
  if (bytes.size() < head || bytes.substr(0, pidfd_magic.size()) != pidfd_magic)
    throw invalid_argument_error("ccalloc: open_ipc_handle_pidfd: not bytes from share_ipc_handle_pidfd (" +
                                 std::to_string(bytes.size()) + " bytes, no \"ccIPCpfd\" header)");
  const auto count = get<std::uint32_t>(bytes, pidfd_magic.size());
  if (count > (bytes.size() - head) / pidfd_entry_bytes)
    throw invalid_argument_error("ccalloc: open_ipc_handle_pidfd: " + std::to_string(count) +
                                 " descriptors announced, more than the " + std::to_string(bytes.size()) +
                                 " bytes hold");
  const std::string_view handle = bytes.substr(head + count * pidfd_entry_bytes);
  const ipc_handle h = parse_ipc_handle(handle);  // invalid_argument_error "ipc handle: ..."
  std::vector<int> taken;
  auto close_taken = [&] {
    for (int fd : taken) ::close(fd);
  };
  if (count > 0) {
    const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(h.producer_pid), 0));
    if (pidfd < 0) fail_call("pidfd_open(" + std::to_string(h.producer_pid) + ")", errno);
    for (std::uint32_t i = 0; i < count; ++i) {
      const auto remote = get<std::int32_t>(bytes, head + i * pidfd_entry_bytes);
      const auto inode = get<std::uint64_t>(bytes, head + i * pidfd_entry_bytes + 4);
      const int fd = static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd, remote, 0));
      if (fd < 0 || inode_of(fd) != inode) {
        const int err = errno;
        if (fd >= 0) ::close(fd);
        close_taken();
        ::close(pidfd);
        if (fd >= 0 || err == EBADF)
          throw backend_error("ccalloc: open_ipc_handle_pidfd: descriptor " + std::to_string(remote) +
                              " of process " + std::to_string(h.producer_pid) +
                              " is no longer the export's: the exporter has freed the block");
        fail_call("pidfd_getfd(process " + std::to_string(h.producer_pid) + ", descriptor " +
                      std::to_string(remote) + ")",
                  err);
      }
      taken.push_back(fd);
    }
    ::close(pidfd);
  }
  try {
    void* out = open_ipc_handle(handle, taken, access_device);
    close_taken();
    return out;
  } catch (...) {
    close_taken();
    throw;
  }
}

}  // namespace ccalloc
