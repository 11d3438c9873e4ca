// Handle + descriptors over a Unix socket (SCM_RIGHTS). See
// include/ccalloc/frontend/ipc_socket.hpp.
#include <ccalloc/frontend/ipc_socket.hpp>

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <vector>

namespace ccalloc {

namespace {
constexpr std::size_t max_handle_bytes = 64 * 1024;
constexpr std::size_t max_fds = 253;  // SCM_MAX_FD
}  // namespace

void send_ipc_handle(int socket, const ipc_export& ex) {
  if (ex.handle.size() > max_handle_bytes)
    throw invalid_argument_error("ccalloc: send_ipc_handle: the handle is " + std::to_string(ex.handle.size()) +
                                 " bytes, more than " + std::to_string(max_handle_bytes));
  if (ex.fds.size() > max_fds)
    throw invalid_argument_error("ccalloc: send_ipc_handle: " + std::to_string(ex.fds.size()) +
                                 " descriptors, more than one message carries (" + std::to_string(max_fds) + ")");
  const auto n = static_cast<std::uint32_t>(ex.handle.size());
  std::string msg(reinterpret_cast<const char*>(&n), sizeof n);
  msg += ex.handle;
  iovec iov{msg.data(), msg.size()};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  std::vector<char> control;
  if (!ex.fds.empty()) {
    control.assign(CMSG_SPACE(sizeof(int) * ex.fds.size()), 0);
    m.msg_control = control.data();
    m.msg_controllen = control.size();
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * ex.fds.size());
    std::memcpy(CMSG_DATA(c), ex.fds.data(), sizeof(int) * ex.fds.size());
  }
  ssize_t sent = -1;
  do sent = ::sendmsg(socket, &m, MSG_NOSIGNAL);
  while (sent < 0 && errno == EINTR);
  if (sent < 0) throw backend_error(std::string("ccalloc: send_ipc_handle: sendmsg failed: ") + std::strerror(errno));
  if (static_cast<std::size_t>(sent) != msg.size())
    throw backend_error("ccalloc: send_ipc_handle: sendmsg sent " + std::to_string(sent) + " of " +
                        std::to_string(msg.size()) + " bytes");
}

ipc_export receive_ipc_handle(int socket) {
  std::vector<char> buf(sizeof(std::uint32_t) + max_handle_bytes);
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
  if (got < 0) throw backend_error(std::string("ccalloc: receive_ipc_handle: recvmsg failed: ") + std::strerror(errno));
  ipc_export ex;
  for (cmsghdr* c = CMSG_FIRSTHDR(&m); c != nullptr; c = CMSG_NXTHDR(&m, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const std::size_t at = ex.fds.size();
    ex.fds.resize(at + count);
    std::memcpy(ex.fds.data() + at, CMSG_DATA(c), count * sizeof(int));
  }
  auto fail = [&](const std::string& what) {
    for (int fd : ex.fds) ::close(fd);
    throw backend_error("ccalloc: receive_ipc_handle: " + what);
  };
  if (got == 0) fail("the peer closed the socket");
  if ((m.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) fail("the message or its descriptors were cut short");
  std::uint32_t n = 0;
  if (static_cast<std::size_t>(got) < sizeof n) fail("a message of " + std::to_string(got) + " bytes has no length");
  std::memcpy(&n, buf.data(), sizeof n);
  if (static_cast<std::size_t>(got) != sizeof n + n)
    fail("the message holds " + std::to_string(got - static_cast<ssize_t>(sizeof n)) + " bytes, its length says " +
         std::to_string(n));
  ex.handle.assign(buf.data() + sizeof n, n);
  return ex;
}

}  // namespace ccalloc
