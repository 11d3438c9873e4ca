// Handle + descriptors over a Unix socket (SCM_RIGHTS). See
// include/ccalloc/frontend/ipc_socket.hpp.
#include <ccalloc/frontend/ipc_socket.hpp>

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <vector>

namespace ccalloc {

namespace {
constexpr std::size_t max_handle_bytes = 64 * 1024;
constexpr std::size_t max_fds = 253;  // SCM_MAX_FD
}  // namespace

namespace {

// Sends `bytes` with `count` descriptors from `fds` as SCM_RIGHTS.
void send_message(int socket, const std::string& bytes, const int* fds, std::size_t count) {
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  std::vector<char> control;
  if (count > 0) {
    control.assign(CMSG_SPACE(sizeof(int) * count), 0);
    m.msg_control = control.data();
    m.msg_controllen = control.size();
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * count);
    std::memcpy(CMSG_DATA(c), fds, sizeof(int) * count);
  }
  ssize_t sent = -1;
  do sent = ::sendmsg(socket, &m, MSG_NOSIGNAL);
  while (sent < 0 && errno == EINTR);
  if (sent < 0) throw backend_error(std::string("ccalloc: send_ipc_handle: sendmsg failed: ") + std::strerror(errno));
  if (static_cast<std::size_t>(sent) != bytes.size())
    throw backend_error("ccalloc: send_ipc_handle: sendmsg sent " + std::to_string(sent) + " of " +
                        std::to_string(bytes.size()) + " bytes");
}

// Receives one message into `buf`; appends its descriptors to `fds`.
// Returns the bytes received.
std::size_t receive_message(int socket, std::vector<char>& buf, std::vector<int>& fds) {
  iovec iov{buf.data(), buf.size()};
  std::vector<char> control(CMSG_SPACE(sizeof(int) * max_fds));
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = control.data();
  m.msg_controllen = control.size();
  ssize_t got = -1;
  do got = ::recvmsg(socket, &m, MSG_CMSG_CLOEXEC);
  while (got < 0 && errno == EINTR);
  const int err = errno;
  if (got >= 0)
    for (cmsghdr* c = CMSG_FIRSTHDR(&m); c != nullptr; c = CMSG_NXTHDR(&m, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      const std::size_t at = fds.size();
      fds.resize(at + count);
      std::memcpy(fds.data() + at, CMSG_DATA(c), count * sizeof(int));
    }
  auto fail = [&](const std::string& what) {
    for (int fd : fds) ::close(fd);
    fds.clear();
    throw backend_error("ccalloc: receive_ipc_handle: " + what);
  };
  if (got < 0) fail(std::string("recvmsg failed: ") + std::strerror(err));
  if (got == 0) fail("the peer closed the socket");
  if ((m.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) fail("the message or its descriptors were cut short");
  return static_cast<std::size_t>(got);
}

}  // namespace

void send_ipc_handle(int socket, const ipc_export& ex) {
  // An empty export (ccalloc_ipc_export_free zeroes one) would reach the peer
  // as a handle that opens nothing.
  if (ex.handle.empty())
    throw invalid_argument_error(
        "ccalloc: send_ipc_handle: the export holds no handle (0 bytes: emptied by ccalloc_ipc_export_free, or "
        "never filled in by a share); send what a share returned");
  if (ex.handle.size() > max_handle_bytes)
    throw invalid_argument_error("ccalloc: send_ipc_handle: the handle is " + std::to_string(ex.handle.size()) +
                                 " bytes, more than " + std::to_string(max_handle_bytes));
  // First message: handle length, descriptor count, handle, and the first
  // max_fds descriptors; then one byte per message with max_fds more each.
  const auto n = static_cast<std::uint32_t>(ex.handle.size());
  const auto count = static_cast<std::uint32_t>(ex.fds.size());
  std::string msg(reinterpret_cast<const char*>(&n), sizeof n);
  msg.append(reinterpret_cast<const char*>(&count), sizeof count);
  msg += ex.handle;
  std::size_t at = std::min<std::size_t>(count, max_fds);
  send_message(socket, msg, ex.fds.data(), at);
  while (at < count) {
    const std::size_t chunk = std::min<std::size_t>(count - at, max_fds);
    send_message(socket, std::string(1, 'f'), ex.fds.data() + at, chunk);
    at += chunk;
  }
}

ipc_export receive_ipc_handle(int socket) {
  std::vector<char> buf(2 * sizeof(std::uint32_t) + max_handle_bytes);
  ipc_export ex;
  const std::size_t got = receive_message(socket, buf, ex.fds);
  auto fail = [&](const std::string& what) {
    for (int fd : ex.fds) ::close(fd);
    throw backend_error("ccalloc: receive_ipc_handle: " + what);
  };
  std::uint32_t n = 0;
  std::uint32_t count = 0;
  if (got < sizeof n + sizeof count) fail("a message of " + std::to_string(got) + " bytes has no header");
  std::memcpy(&n, buf.data(), sizeof n);
  std::memcpy(&count, buf.data() + sizeof n, sizeof count);
  if (got != sizeof n + sizeof count + n)
    fail("the message holds " + std::to_string(got - sizeof n - sizeof count) + " bytes, its length says " +
         std::to_string(n));
  ex.handle.assign(buf.data() + sizeof n + sizeof count, n);
  while (ex.fds.size() < count) {
    const std::size_t before = ex.fds.size();
    (void)receive_message(socket, buf, ex.fds);  // closes ex.fds and throws on failure
    if (ex.fds.size() == before) fail("a continuation message carried no descriptors");
  }
  if (ex.fds.size() != count)
    fail("received " + std::to_string(ex.fds.size()) + " descriptors, the handle's message announced " +
         std::to_string(count));
  return ex;
}

}  // namespace ccalloc
