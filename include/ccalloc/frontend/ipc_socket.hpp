// ccalloc/frontend/ipc_socket.hpp: sending an IPC handle and its file
// descriptors to another process over a Unix socket (SPEC F25).
//
// What it is: the transport share_ipc_handle's result needs, since file
// descriptors cannot travel as bytes: the handle's bytes and, as SCM_RIGHTS
// ancillary data, the descriptors (the kernel installs copies in the
// receiver). One message carries at most 253 descriptors (SCM_MAX_FD), so an
// expandable handle of more pages (a block over ~506 MiB with 2 MiB pages)
// goes as one message plus continuation messages; the first message says how
// many descriptors follow. Use a connected AF_UNIX socket of type
// SOCK_SEQPACKET (message boundaries kept), one handle at a time per socket.
// Handles up to 64 KiB. Each received descriptor counts against the
// receiver's RLIMIT_NOFILE until closed.
//
// Thread safety: the functions touch only the socket; concurrent calls on
// one socket interleave messages.
#pragma once

#include <ccalloc/frontend/caching_allocator.hpp>

namespace ccalloc {

/// Sends `ex` (handle bytes and descriptors) as one message on `socket`.
/// The descriptors stay the caller's (close them after sending). Throws
/// invalid_argument_error for a handle over 64 KiB, backend_error naming
/// errno's text when sendmsg fails.
void send_ipc_handle(int socket, const ipc_export& ex);

/// Receives one message sent by send_ipc_handle on `socket` (blocks until it
/// arrives). The received descriptors are new in this process and owned by
/// the caller (close them after open_ipc_handle). Throws backend_error when
/// recvmsg fails, the peer closed the socket, or the message is cut short
/// (the descriptors received so far are closed then).
[[nodiscard]] ipc_export receive_ipc_handle(int socket);

}  // namespace ccalloc
