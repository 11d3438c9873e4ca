// The exporter's side of expandable IPC (SPEC C3): stable handles, the
// lease, and the owner's free deferred while importers hold the block. See
// ipc_export.hpp and docs/design.md, "IPC of expandable memory".
#include "ipc_export.hpp"

#include <ccalloc/base/detail/pointer_text.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>
#include <ccalloc/frontend/ipc_handle.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace ccalloc {

namespace detail {

namespace {

// Duplicates of `fds` for a caller who will close them.
std::vector<int> duplicates(const std::vector<int>& fds) {
  std::vector<int> out;
  out.reserve(fds.size());
  for (int fd : fds) {
    const int d = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (d < 0) {
      const int err = errno;
      for (int o : out) ::close(o);
      throw backend_error(std::string("ccalloc: share_ipc_handle: fcntl(F_DUPFD_CLOEXEC) failed: ") +
                          std::strerror(err));
    }
    out.push_back(d);
  }
  return out;
}

}  // namespace

ipc_exports::~ipc_exports() {
  for (auto& [ptr, e] : entries) close_fds(e);
}

void ipc_exports::close_fds(entry& e) noexcept {
  for (int fd : e.fds) ::close(fd);
  e.fds.clear();
}

ipc_export share_expandable(ipc_exports& exports, device_backend& backend, int device, block* blk, void* ptr,
                            ipc_handle h, const block_segment& seg) {
  std::lock_guard lock(exports.mutex);
  const auto key = reinterpret_cast<std::uintptr_t>(ptr);
  if (auto it = exports.entries.find(key); it != exports.entries.end()) {
    ipc_export out;
    out.handle = it->second.handle;
    out.fds = duplicates(it->second.fds);
    return out;
  }
  ipc_exports::entry e;
  e.device = device;
  e.blk = blk;
  e.size_bytes = h.size_bytes;
  h.kind = ipc_kind::expandable;
  h.version = ipc_handle_version;
  h.page_bytes = seg.page_bytes;
  h.first_page = seg.first_page;
  try {
    for (std::size_t i = 0; i < seg.page_handles.size(); ++i) {
      const shareable_handle s = backend.vm_export_handle(device, seg.page_handles[i]);
      e.fds.push_back(s.fd);
      h.pages.push_back(ipc_page{static_cast<std::uint32_t>(i), s.offset_bytes});
    }
    e.lease = ipc_lease::create();
    h.lease_fd_index = static_cast<std::uint32_t>(e.fds.size());
    e.fds.push_back(duplicates({e.lease.fd()}).front());
    e.handle = encode_ipc_handle(h);
  } catch (...) {
    ipc_exports::close_fds(e);
    throw;
  }
  ipc_export out;
  out.handle = e.handle;
  out.fds = duplicates(e.fds);  // throws with nothing registered yet; e closes its own
  exports.entries.emplace(key, std::move(e));
  exports.count->store(exports.entries.size());
  return out;
}

}  // namespace detail

bool caching_allocator::defer_exported_free(void* ptr) {
  detail::ipc_exports& ex = *exports_;
  std::lock_guard lock(ex.mutex);
  auto it = ex.entries.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == ex.entries.end()) return false;
  detail::ipc_exports::entry& e = it->second;
  e.lease.revoke();  // before counting: an importer that claims after this sees it and maps nothing
  if (e.lease.holders() > 0) {
    e.owner_freed = true;
    return true;
  }
  detail::ipc_exports::close_fds(e);
  ex.entries.erase(it);
  ex.count->store(ex.entries.size());
  return false;
}

std::size_t caching_allocator::reclaim_ipc_exports() {
  detail::ipc_exports& ex = *exports_;
  std::lock_guard lock(ex.mutex);
  std::size_t freed = 0;
  for (auto it = ex.entries.begin(); it != ex.entries.end();) {
    detail::ipc_exports::entry& e = it->second;
    if (!e.owner_freed || e.lease.holders() > 0) {
      ++it;
      continue;
    }
    devices_[static_cast<std::size_t>(e.device)]->free(e.blk);  // throws: the entry stays, as does the block
    detail::ipc_exports::close_fds(e);
    it = ex.entries.erase(it);
    ex.count->store(ex.entries.size());
    ++freed;
  }
  return freed;
}

std::vector<ipc_export_info> caching_allocator::ipc_exports() const {
  detail::ipc_exports& ex = *exports_;
  std::lock_guard lock(ex.mutex);
  std::vector<ipc_export_info> out;
  for (auto& [ptr, e] : ex.entries)
    out.push_back(ipc_export_info{reinterpret_cast<void*>(ptr), e.device, e.size_bytes, e.lease.holders(),
                                  e.owner_freed});
  return out;
}

}  // namespace ccalloc
