// Inter-process sharing (SPEC F25) and copies (F27, F28) of the front end.
// The handle format is in ipc_handle.cpp; the cache of opened handles is
// described in ipc_cache.hpp.
#include "ipc_cache.hpp"
#include "ipc_export.hpp"

#include <ccalloc/base/detail/pointer_text.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace ccalloc {

namespace {

using detail::pointer_text;

// What identifies the memory a handle maps in this process: the producer,
// its segment, and (expandable) the page range and the pages' file offsets.
// Two handles with one key map the same bytes, so the mapping is shared.
std::string cache_key(const ipc_handle& h) {
  std::string key = std::to_string(h.producer_pid) + "/" + std::to_string(h.device) + "/" +
                    std::to_string(static_cast<int>(h.kind)) + "/" + std::to_string(h.segment_id) + "/" +
                    std::to_string(h.segment_bytes);
  if (h.kind == ipc_kind::plain) {
    key.append(reinterpret_cast<const char*>(h.mem_handle.data()), h.mem_handle.size());
  } else {
    // append, not "/" + std::string: GCC 12's -Wrestrict misfires on the latter at -O3
    key.append("/").append(std::to_string(h.page_bytes)).append("/").append(std::to_string(h.first_page));
    for (const ipc_page& p : h.pages) key.append("/").append(std::to_string(p.file_offset));
  }
  return key;
}

// An entry already open for another device: an expandable mapping is shared
// by every device of this process, so the new one is granted its pages (a
// plain entry is per device: the key holds it).
void grant_accessor(detail::ipc_cache& cache, detail::ipc_cache::entry& e, int access_device) {
  if (e.kind == ipc_kind::expandable && access_device != e.device &&
      std::find(e.accessors.begin(), e.accessors.end(), access_device) == e.accessors.end()) {
    cache.grant_pages(e, access_device);
    e.accessors.push_back(access_device);
  }
}

// A plain segment's handle opened for the accessing device: the backend
// enables peer access to the owner as needed (cudaIpcMemLazyEnablePeerAccess).
detail::ipc_cache::entry open_plain(device_backend& backend, const ipc_handle& h, int access_device) {
  detail::ipc_cache::entry e;
  e.kind = h.kind;
  e.device = h.device;
  ipc_mem_handle m;
  m.bytes = h.mem_handle;
  e.base = reinterpret_cast<std::uintptr_t>(backend.ipc_open_segment(access_device, m));
  e.open_device = access_device;
  e.bytes = h.segment_bytes;
  return e;
}

// Imports and maps the handle's pages one after the other into e's range
// (e.imported: those mapped so far, for the caller's undo).
void import_pages(device_backend& backend, const ipc_handle& h, std::span<const int> fds,
                  detail::ipc_cache::entry& e) {
  for (const ipc_page& p : h.pages) {
    const physical_handle_t ph =
        backend.vm_import_handle(h.device, shareable_handle{fds[p.fd_index], p.file_offset, h.page_bytes});
    try {
      backend.vm_map(h.device, reinterpret_cast<void*>(e.base + e.imported.size() * h.page_bytes), h.page_bytes, ph);
    } catch (...) {
      backend.vm_release_handle(h.device, ph);
      throw;
    }
    e.imported.push_back(ph);
  }
}

// Undoes a failed open_expandable: unmaps and releases the pages mapped so
// far (page by page: the mapped prefix may be empty), the address range
// and the lease slot. Errors are dropped: the first one is the one reported.
void undo_open(device_backend& backend, const ipc_handle& h, detail::ipc_cache::entry& e) {
  for (std::size_t i = 0; i < e.imported.size(); ++i) {
    try {
      backend.vm_unmap(h.device, reinterpret_cast<void*>(e.base + i * h.page_bytes), h.page_bytes);
      backend.vm_release_handle(h.device, e.imported[i]);
    } catch (...) {  // keep cleaning up; the first error is the one reported
    }
  }
  try {
    backend.vm_release(h.device, reinterpret_cast<void*>(e.base), e.bytes);
  } catch (...) {  // keep cleaning up, as above
  }
  if (e.lease.valid()) e.lease.release(e.lease_slot);
}

// An expandable segment's handle: an address range reserved, the lease slot
// taken (from then on the producer keeps the pages), the pages imported and
// mapped, and access granted to the device's peers (`grant`, F26) and to the
// accessing device. Nothing is left behind when a step fails.
detail::ipc_cache::entry open_expandable(device_backend& backend, detail::ipc_cache& cache, const ipc_handle& h,
                                         std::span<const int> fds, int access_device, std::vector<int> grant) {
  detail::ipc_cache::entry e;
  e.kind = h.kind;
  e.device = h.device;
  e.open_device = h.device;
  e.page_bytes = h.page_bytes;
  e.bytes = h.pages.size() * h.page_bytes;
  void* base = backend.vm_reserve(h.device, e.bytes);
  if (base == nullptr)
    throw backend_error("ccalloc: open_ipc_handle: no address space for " + std::to_string(e.bytes) + " bytes");
  e.base = reinterpret_cast<std::uintptr_t>(base);
  try {
    if (h.has_lease()) {
      detail::ipc_lease lease = detail::ipc_lease::open(fds[h.lease_fd_index]);
      e.lease_slot = lease.acquire();
      e.lease = std::move(lease);  // valid from here: the slot is held
    }
    import_pages(backend, h, fds, e);
    if (access_device != h.device && std::find(grant.begin(), grant.end(), access_device) == grant.end())
      grant.push_back(access_device);
    for (int peer : grant) cache.grant_pages(e, peer);
    if (access_device != h.device) e.accessors.push_back(access_device);
  } catch (...) {
    undo_open(backend, h, e);
    throw;
  }
  return e;
}

}  // namespace

namespace detail {

ipc_cache::~ipc_cache() {
  for (auto& [key, e] : entries) close(e, /*quiet=*/true);
}

void ipc_cache::close(entry& e, bool quiet) {
  try {
    if (e.kind == ipc_kind::plain) {
      backend.ipc_close_segment(e.open_device, reinterpret_cast<void*>(e.base));
      return;
    }
    void* base = reinterpret_cast<void*>(e.base);
    // Page by page, as mapped (cuMemUnmap of a range spanning several
    // mappings is not promised by every driver).
    for (std::size_t i = 0; i < e.imported.size(); ++i)
      backend.vm_unmap(e.device, reinterpret_cast<void*>(e.base + i * e.page_bytes), e.page_bytes);
    for (physical_handle_t h : e.imported) backend.vm_release_handle(e.device, h);
    backend.vm_release(e.device, base, e.bytes);
    // Nothing of the producer's pages is mapped here any more: let it reclaim them.
    if (e.lease.valid()) e.lease.release(e.lease_slot);
  } catch (...) {
    if (!quiet) throw;
  }
}

void ipc_cache::grant_pages(const entry& e, int device) {
  for (std::size_t i = 0; i < e.imported.size(); ++i)
    backend.vm_set_access(e.device, reinterpret_cast<void*>(e.base + i * e.page_bytes), e.page_bytes, device);
}

bool ipc_cache::has_expandable(int device) const {
  for (const auto& [key, e] : entries)
    if (e.device == device && e.kind == ipc_kind::expandable) return true;
  return false;
}

}  // namespace detail

ipc_export caching_allocator::share_ipc_handle(void* ptr) {
  const auto found = find_entry(ptr);
  if (!found)
    throw invalid_argument_error("ccalloc: share_ipc_handle(" + pointer_text(ptr) +
                                 "): not a live allocation of this allocator (share the pointer malloc returned)");
  device_caching_allocator& dev = *devices_[static_cast<std::size_t>(found->device)];
  // Memory under a named tag may be paused: an importer would keep the old
  // pages (the device memory would not be freed) and see stale bytes after
  // the resume maps new ones. Refused rather than silently wrong.
  if (const std::string tag = dev.block_tag(found->block); tag != default_tag_name)
    throw invalid_argument_error("ccalloc: share_ipc_handle(" + pointer_text(ptr) + "): the block is under tag '" +
                                 tag + "', which pause may release; share memory allocated under the default tag");
  const block_segment seg = dev.segment_of(found->block);
  ipc_handle h;
  h.device = found->device;
  h.producer_pid = static_cast<std::uint32_t>(::getpid());
  h.segment_id = seg.base;
  h.segment_bytes = seg.size_bytes;
  h.offset_bytes = reinterpret_cast<std::uintptr_t>(ptr) - seg.base;
  h.size_bytes = dev.block_size(found->block);
  ipc_export out;
  const backend_capabilities caps = backend_->capabilities();
  if (!seg.expandable) {
    if (!caps.ipc)
      throw backend_error("ccalloc: share_ipc_handle(" + pointer_text(ptr) + "): the block is in a plain segment and the '" +
                          backend_->name() +
                          "' backend cannot share plain segments (capabilities().ipc is false; with "
                          "expandable_segments:True blocks live in expandable segments, which it may share)");
    h.kind = ipc_kind::plain;
    h.mem_handle = backend_->ipc_export_segment(found->device, reinterpret_cast<void*>(seg.base)).bytes;
    out.handle = encode_ipc_handle(h);
    return out;
  }
  if (!caps.ipc_vm)
    throw backend_error("ccalloc: share_ipc_handle(" + pointer_text(ptr) + "): the block is in an expandable segment and the '" +
                        backend_->name() + "' backend cannot export its pages (capabilities().ipc_vm is false)");
  return detail::share_expandable(*exports_, *backend_, found->device, found->block, ptr, std::move(h), seg);
}

void* caching_allocator::open_ipc_handle(std::string_view bytes, std::span<const int> fds, int access_device) {
  const ipc_handle h = parse_ipc_handle(bytes);  // invalid_argument_error "ipc handle: ..."
  (void)checked_device(h.device, "open_ipc_handle");
  if (access_device == -1) access_device = h.device;
  (void)checked_device(access_device, "open_ipc_handle (access_device)");
  if (access_device != h.device && !backend_->can_access_peer(access_device, h.device))
    throw backend_error("ccalloc: open_ipc_handle: device " + std::to_string(access_device) +
                        " cannot access device " + std::to_string(h.device) + " on the '" + backend_->name() +
                        "' backend (no peer-to-peer path)");
  if (fds.size() != h.fd_count())
    throw invalid_argument_error("ccalloc: open_ipc_handle: the handle needs " + std::to_string(h.fd_count()) +
                                 " file descriptor(s), got " + std::to_string(fds.size()));
  std::string key = cache_key(h);
  // CUDA maps a plain segment into the context it is opened in, and peer
  // access does not reach such a mapping from another device (measured on
  // two H200s: a kernel on the owner's device faulted on a mapping opened
  // for the other one): one mapping per accessing device.
  if (h.kind == ipc_kind::plain) key.append("/for").append(std::to_string(access_device));
  detail::ipc_cache& cache = *ipc_;
  std::lock_guard lock(cache.mutex);
  auto it = cache.entries.find(key);
  if (it != cache.entries.end()) {
    grant_accessor(cache, it->second, access_device);
  } else {
    detail::ipc_cache::entry e =
        h.kind == ipc_kind::plain
            ? open_plain(*backend_, h, access_device)
            : open_expandable(*backend_, cache, h, fds, access_device,
                              devices_[static_cast<std::size_t>(h.device)]->peers());
    it = cache.entries.emplace(key, std::move(e)).first;
  }
  const std::uintptr_t block_offset =
      h.kind == ipc_kind::plain ? h.offset_bytes : h.offset_bytes - h.first_page * h.page_bytes;
  const std::uintptr_t ptr = it->second.base + block_offset;
  ++it->second.opened[ptr];
  ++it->second.refs;
  return reinterpret_cast<void*>(ptr);
}

void caching_allocator::close_ipc_handle(void* ptr) {
  const auto a = reinterpret_cast<std::uintptr_t>(ptr);
  detail::ipc_cache& cache = *ipc_;
  std::lock_guard lock(cache.mutex);
  for (auto it = cache.entries.begin(); it != cache.entries.end(); ++it) {
    auto& e = it->second;
    if (a < e.base || a - e.base >= e.bytes) continue;
    // Only a pointer open_ipc_handle returned: an interior one would drop a
    // reference another holder still counts on.
    const auto opened = e.opened.find(a);
    if (opened == e.opened.end()) break;
    if (e.refs > 1) {
      --e.refs;
      if (--opened->second == 0) e.opened.erase(opened);
      return;
    }
    cache.close(e, /*quiet=*/false);  // throws with the entry still open: the caller may retry
    cache.entries.erase(it);
    return;
  }
  throw invalid_argument_error("ccalloc: close_ipc_handle(" + pointer_text(ptr) +
                               "): not a pointer from open_ipc_handle that is still open");
}

std::size_t caching_allocator::ipc_open_mappings() const {
  std::lock_guard lock(ipc_->mutex);
  return ipc_->entries.size();
}

void caching_allocator::memcpy_async(void* dst, int dst_device, const void* src, int src_device,
                                     std::size_t size_bytes, stream_t stream, bool p2p_enabled) {
  device_caching_allocator& to = checked_device(dst_device, "memcpy_async (dst_device)");
  device_caching_allocator& from = checked_device(src_device, "memcpy_async (src_device)");
  if (size_bytes == 0) return;
  bool expandable_memory = false;
  if (!p2p_enabled && dst_device != src_device) {
    std::lock_guard lock(ipc_->mutex);
    expandable_memory = !to.expandable_segments().empty() || !from.expandable_segments().empty() ||
                        ipc_->has_expandable(dst_device) || ipc_->has_expandable(src_device);
  }
  if (!expandable_memory)
    backend_->memcpy_async(backend_->current_device(), dst, src, size_bytes, stream);
  else
    backend_->memcpy_peer_async(dst, dst_device, src, src_device, size_bytes, stream);
}

void caching_allocator::copy_data(void* dst, const void* src, std::size_t size_bytes) const {
  if (size_bytes == 0) return;
  backend_->copy_data(backend_->current_device(), dst, src, size_bytes);
}

}  // namespace ccalloc
