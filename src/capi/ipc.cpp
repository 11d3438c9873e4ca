// The C API: sharing memory with other processes (SPEC F25-F28, C3): export
// handles of expandable blocks, send and receive them over Unix sockets,
// open and close them, reclaim blocks no importer holds.
#include "capi.hpp"

#include <ccalloc/frontend/ipc_socket.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <new>
#include <span>
#include <string>
#include <string_view>

#include <unistd.h>

using namespace ccalloc::capi_detail;  // NOLINT(google-build-using-namespace)

namespace {

// ---- inter-process sharing: the C copies of an ipc_export

/// Copies `ex` into library memory in *out; the descriptors move to *out.
void to_c_export(const ccalloc::ipc_export& ex, ccalloc_ipc_export_t* out) {
  auto* handle = static_cast<char*>(std::malloc(ex.handle.size() == 0 ? 1 : ex.handle.size()));
  auto* fds = static_cast<int*>(std::malloc(ex.fds.empty() ? sizeof(int) : ex.fds.size() * sizeof(int)));
  if (handle == nullptr || fds == nullptr) {
    std::free(handle);
    std::free(fds);
    throw std::bad_alloc();
  }
  std::memcpy(handle, ex.handle.data(), ex.handle.size());
  if (!ex.fds.empty()) std::memcpy(fds, ex.fds.data(), ex.fds.size() * sizeof(int));
  *out = ccalloc_ipc_export_t{handle, ex.handle.size(), fds, ex.fds.size()};
}

/// Runs `share` (which returns an ipc_export) and moves its result into
/// *out; closes the descriptors when that fails.
template <typename Share>
void share_into(ccalloc_ipc_export_t* out, const char* function, Share&& share) {
  require(out, function, "out");
  ccalloc::ipc_export ex = share();
  try {
    to_c_export(ex, out);
  } catch (...) {
    for (int fd : ex.fds) ::close(fd);
    throw;
  }
}

}  // namespace

extern "C" {

// ---- inter-process sharing ----------------------------------------------------------------------

ccalloc_status_t ccalloc_share_ipc_handle(ccalloc_allocator_t* alloc, void* ptr, ccalloc_ipc_export_t* out) {
  return guarded([&] { share_into(out, "ccalloc_share_ipc_handle", [&] { return resolve(alloc).share_ipc_handle(ptr); }); });
}

void ccalloc_ipc_export_free(ccalloc_ipc_export_t* ex, int close_fds) {
  if (ex == nullptr) return;
  if (close_fds != 0 && ex->fds != nullptr)
    for (std::size_t i = 0; i < ex->fd_count; ++i) ::close(ex->fds[i]);
  std::free(ex->handle);
  std::free(ex->fds);
  *ex = ccalloc_ipc_export_t{};
}

ccalloc_status_t ccalloc_send_ipc_handle(int socket, const ccalloc_ipc_export_t* ex) {
  return guarded([&] {
    require(ex, "ccalloc_send_ipc_handle", "ex");
    if (ex->handle_bytes > 0) require(ex->handle, "ccalloc_send_ipc_handle", "ex->handle");
    if (ex->fd_count > 0) require(ex->fds, "ccalloc_send_ipc_handle", "ex->fds");
    ccalloc::ipc_export copy;
    copy.handle.assign(ex->handle == nullptr ? "" : ex->handle, ex->handle_bytes);
    if (ex->fd_count > 0) copy.fds.assign(ex->fds, ex->fds + ex->fd_count);
    ccalloc::send_ipc_handle(socket, copy);
  });
}

ccalloc_status_t ccalloc_receive_ipc_handle(int socket, ccalloc_ipc_export_t* out) {
  return guarded([&] { share_into(out, "ccalloc_receive_ipc_handle", [&] { return ccalloc::receive_ipc_handle(socket); }); });
}

ccalloc_status_t ccalloc_open_ipc_handle(ccalloc_allocator_t* alloc, const void* handle, size_t handle_bytes,
                                         const int* fds, size_t fd_count, int access_device, void** out) {
  return guarded([&] {
    require(out, "ccalloc_open_ipc_handle", "out");
    require(handle, "ccalloc_open_ipc_handle", "handle");
    if (fd_count > 0) require(fds, "ccalloc_open_ipc_handle", "fds");
    *out = resolve(alloc).open_ipc_handle(std::string_view(static_cast<const char*>(handle), handle_bytes),
                                          std::span<const int>(fds, fd_count), access_device);
  });
}

ccalloc_status_t ccalloc_share_ipc_handle_pidfd(ccalloc_allocator_t* alloc, void* ptr, char* buffer,
                                                size_t capacity, size_t* length) {
  return guarded([&] {
    require(length, "ccalloc_share_ipc_handle_pidfd", "length");
    if (capacity > 0) require(buffer, "ccalloc_share_ipc_handle_pidfd", "buffer (with capacity > 0)");
    const std::string bytes = resolve(alloc).share_ipc_handle_pidfd(ptr);
    if (capacity > 0) std::memcpy(buffer, bytes.data(), std::min(bytes.size(), capacity));
    *length = bytes.size();
  });
}

ccalloc_status_t ccalloc_open_ipc_handle_pidfd(ccalloc_allocator_t* alloc, const void* bytes, size_t byte_count,
                                               int access_device, void** out) {
  return guarded([&] {
    require(out, "ccalloc_open_ipc_handle_pidfd", "out");
    require(bytes, "ccalloc_open_ipc_handle_pidfd", "bytes");
    *out = resolve(alloc).open_ipc_handle_pidfd(std::string_view(static_cast<const char*>(bytes), byte_count),
                                                access_device);
  });
}

ccalloc_status_t ccalloc_close_ipc_handle(ccalloc_allocator_t* alloc, void* ptr) {
  return guarded([&] { resolve(alloc).close_ipc_handle(ptr); });
}

ccalloc_status_t ccalloc_reclaim_ipc_exports(ccalloc_allocator_t* alloc, size_t* freed) {
  return guarded([&] {
    const std::size_t n = resolve(alloc).reclaim_ipc_exports();
    if (freed != nullptr) *freed = n;
  });
}

ccalloc_status_t ccalloc_ipc_export_status(ccalloc_allocator_t* alloc, void* ptr, size_t* importers,
                                           int* owner_freed) {
  return guarded([&] {
    for (const ccalloc::ipc_export_info& e : resolve(alloc).ipc_exports()) {
      if (e.ptr != ptr) continue;
      if (importers != nullptr) *importers = e.importers;
      if (owner_freed != nullptr) *owner_freed = e.owner_freed ? 1 : 0;
      return;
    }
    throw ccalloc::invalid_argument_error("ccalloc: ccalloc_ipc_export_status(" +
                                          ccalloc::detail::pointer_text(ptr) +
                                          "): not an exported expandable block of this allocator");
  });
}

}  // extern "C"
