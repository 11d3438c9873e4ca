// The C API: private pools, their segment allocators, peer access.
#include "capi.hpp"

#include <ccalloc/base/printable_text.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

using namespace ccalloc::capi_detail;  // NOLINT(google-build-using-namespace)

namespace {

/// Makes `device` the calling thread's current device of `backend` while it
/// lives (cudaSetDevice), then restores the previous one. Throws
/// backend_error if the device cannot be made current.
class current_device_guard {
 public:
  current_device_guard(ccalloc::device_backend& backend, int device)
      : backend_(backend), previous_(backend.current_device()) {
    if (previous_ != device) {
      backend_.set_device(device);
      changed_ = true;
    }
  }
  ~current_device_guard() {
    if (!changed_) return;
    try {
      backend_.set_device(previous_);
    } catch (...) {  // the previous device was valid a moment ago; nothing to report to
    }
  }
  current_device_guard(const current_device_guard&) = delete;
  current_device_guard& operator=(const current_device_guard&) = delete;

 private:
  ccalloc::device_backend& backend_;
  int previous_;
  bool changed_ = false;
};

/// A pool's C segment allocator as the core's segment_allocator: each call
/// runs with `device` current; a failed malloc is nullptr (the core's
/// out-of-memory path) and leaves its code in tls_segment_failure; a failed
/// free is a backend_error. `backend` outlives the allocator that holds the
/// functions (ccalloc_allocator declares it first; the process-wide one is
/// never destroyed).
ccalloc::segment_allocator wrap_segment_allocator(ccalloc::device_backend& backend, int device,
                                                  ccalloc::mempool_id_t pool,
                                                  std::function<int(void**, std::size_t)> malloc_fn,
                                                  std::function<int(void*)> free_fn) {
  ccalloc::segment_allocator out;
  out.malloc = [&backend, device, pool, malloc_fn, free_fn](std::size_t size_bytes) -> void* {
    void* ptr = nullptr;
    int code = 0;
    {
      current_device_guard current(backend, device);
      code = malloc_fn(&ptr, size_bytes);
    }
    if (code != 0 || ptr == nullptr) {
      tls_segment_failure = {true, code, device, pool};
      return nullptr;
    }
    if (reinterpret_cast<std::uintptr_t>(ptr) % 512 != 0) {
      {
        current_device_guard current(backend, device);
        (void)free_fn(ptr);
      }
      throw ccalloc::backend_error("ccalloc: the segment allocator of private pool " + ccalloc::to_string(pool) +
                                   " of device " + std::to_string(device) + " returned " + pointer_text(ptr) +
                                   ", which is not aligned to 512 bytes (given back)");
    }
    return ptr;
  };
  out.free = [&backend, device, pool, free_fn](void* ptr) {
    int code = 0;
    {
      current_device_guard current(backend, device);
      code = free_fn(ptr);
    }
    if (code != 0)
      throw ccalloc::backend_error("ccalloc: the segment allocator of private pool " + ccalloc::to_string(pool) +
                                   " of device " + std::to_string(device) + " failed to free " +
                                   pointer_text(ptr) + ": its free returned " + std::to_string(code) +
                                   " (the segment stays cached in the pool)");
  };
  return out;
}

}  // namespace

extern "C" {

// ---- private pools ---------------------------------------------------------------------------------------

ccalloc_status_t ccalloc_new_pool_id(ccalloc_allocator_t* /*alloc*/, ccalloc_mempool_id_t* out) {
  return guarded([&] {
    require(out, "ccalloc_new_pool_id", "out");
    const ccalloc::mempool_id_t id = caching_allocator::new_pool_id();  // shared with C++
    *out = ccalloc_mempool_id_t{id.first, id.second};
  });
}

ccalloc_status_t ccalloc_create_pool(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id,
                                     ccalloc_segment_malloc_fn malloc_fn, ccalloc_segment_free_fn free_fn) {
  return guarded([&] {
    if ((malloc_fn == nullptr) != (free_fn == nullptr))
      throw ccalloc::invalid_argument_error(std::string("ccalloc: ccalloc_create_pool: ") +
                                            (malloc_fn == nullptr ? "malloc_fn" : "free_fn") +
                                            " is NULL but the other segment function is not; give both or neither");
    caching_allocator& a = resolve(alloc);
    const ccalloc::mempool_id_t pool = to_pool_id(id);
    ccalloc::segment_allocator custom;
    if (malloc_fn != nullptr) {
      custom = wrap_segment_allocator(a.backend(), device, pool, malloc_fn, free_fn);
      custom_segment_pools.store(true, std::memory_order_relaxed);
    }
    a.create_or_incref_pool(device, pool, std::move(custom));
  });
}

ccalloc_status_t ccalloc_release_pool(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id) {
  return guarded([&] { resolve(alloc).release_pool(device, to_pool_id(id)); });
}

ccalloc_status_t ccalloc_pool_use_count(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id, int* out) {
  return guarded([&] {
    require(out, "ccalloc_pool_use_count", "out");
    *out = resolve(alloc).get_pool_use_count(device, to_pool_id(id));
  });
}

ccalloc_status_t ccalloc_begin_allocate_to_pool(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id,
                                                ccalloc_stream_t stream, int all_streams) {
  return guarded([&] {
    ccalloc::caching_allocator& a = resolve(alloc);
    ccalloc::stream_filter filter;
    if (all_streams != 0) {
      filter = [](ccalloc::stream_t) { return true; };
    } else {
      // The allocator sees resolved streams: cudaStreamPerThread is this
      // thread's stream (a bad device is reported by begin_allocate_to_pool).
      ccalloc::stream_t only = to_stream(stream);
      if (device >= 0 && device < a.backend().device_count()) only = a.backend().resolve_stream(device, only);
      filter = [only](ccalloc::stream_t s) { return s == only; };
    }
    a.begin_allocate_to_pool(device, to_pool_id(id), std::move(filter));
  });
}

ccalloc_status_t ccalloc_begin_allocate_to_pool_filter(ccalloc_allocator_t* alloc, int device,
                                                       ccalloc_mempool_id_t id, ccalloc_stream_filter_fn filter,
                                                       void* user_data, ccalloc_user_data_release_fn release) {
  // Owns user_data: releases it once, when the last copy of the filter goes.
  std::shared_ptr<void> owned(user_data, [release](void* p) {
    if (release != nullptr) release(p);
  });
  return guarded([&] {
    require(reinterpret_cast<const void*>(filter), "ccalloc_begin_allocate_to_pool_filter", "filter");
    ccalloc::stream_filter wrapped = [filter, owned](ccalloc::stream_t s) {
      // The allocator asks with resolved streams, on the allocating thread: a
      // per-thread default stream is that thread's cudaStreamPerThread, the
      // handle the caller's filter can pass to CUDA (the resolved value is not
      // a cudaStream_t).
      if (ccalloc::device_backend::is_per_thread_stream(s)) s = ccalloc::per_thread_stream_handle;
      return filter(owned.get(), from_stream(s)) != 0;
    };
    resolve(alloc).begin_allocate_to_pool(device, to_pool_id(id), std::move(wrapped));
  });
}

ccalloc_status_t ccalloc_create_pool_with_source(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id,
                                                 ccalloc_segment_malloc_ud_fn malloc_fn,
                                                 ccalloc_segment_free_ud_fn free_fn, void* user_data) {
  return guarded([&] {
    require(reinterpret_cast<const void*>(malloc_fn), "ccalloc_create_pool_with_source", "malloc_fn");
    require(reinterpret_cast<const void*>(free_fn), "ccalloc_create_pool_with_source", "free_fn");
    caching_allocator& a = resolve(alloc);
    const ccalloc::mempool_id_t pool = to_pool_id(id);
    ccalloc::segment_allocator custom = wrap_segment_allocator(
        a.backend(), device, pool,
        [malloc_fn, user_data](void** ptr, std::size_t size) { return malloc_fn(user_data, ptr, size); },
        [free_fn, user_data](void* ptr) { return free_fn(user_data, ptr); });
    custom_segment_pools.store(true, std::memory_order_relaxed);
    a.create_or_incref_pool(device, pool, std::move(custom));
  });
}

ccalloc_status_t ccalloc_set_use_on_oom(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id,
                                        int enabled) {
  return guarded([&] { resolve(alloc).set_use_on_oom(device, to_pool_id(id), enabled != 0); });
}

ccalloc_status_t ccalloc_set_no_split(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id, int enabled) {
  return guarded([&] { resolve(alloc).set_no_split(device, to_pool_id(id), enabled != 0); });
}

ccalloc_status_t ccalloc_check_pool_live_allocations(ccalloc_allocator_t* alloc, int device,
                                                     ccalloc_mempool_id_t id, void* const* ptrs, size_t count,
                                                     int* out) {
  return guarded([&] {
    require(out, "ccalloc_check_pool_live_allocations", "out");
    if (count > 0) require(ptrs, "ccalloc_check_pool_live_allocations", "ptrs (with count > 0)");
    const std::vector<void*> expected(ptrs, ptrs + count);
    *out = resolve(alloc).check_pool_live_allocations(device, to_pool_id(id), expected) ? 1 : 0;
  });
}

ccalloc_status_t ccalloc_get_checkpoint_state(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id,
                                              ccalloc_pool_checkpoint_t** out) {
  return guarded([&] {
    require(out, "ccalloc_get_checkpoint_state", "out");
    auto checkpoint = std::make_unique<ccalloc_pool_checkpoint>();
    checkpoint->state = resolve(alloc).get_checkpoint_state(device, to_pool_id(id));
    *out = checkpoint.release();
  });
}

void ccalloc_pool_checkpoint_destroy(ccalloc_pool_checkpoint_t* checkpoint) { delete checkpoint; }

ccalloc_status_t ccalloc_set_checkpoint_pool_state(ccalloc_allocator_t* alloc, int device,
                                                   const ccalloc_pool_checkpoint_t* checkpoint,
                                                   ccalloc_checkpoint_block_fn on_block, void* user_data) {
  return guarded([&] {
    require(checkpoint, "ccalloc_set_checkpoint_pool_state", "checkpoint");
    caching_allocator& a = resolve(alloc);
    const ccalloc::checkpoint_restore_result result = a.set_checkpoint_pool_state(device, checkpoint->state);
    if (on_block == nullptr) return;
    for (void* ptr : result.freed_pointers) on_block(user_data, ptr, 0, 0);
    for (const ccalloc::allocation& created : result.blocks_created)
      on_block(user_data, created.ptr, a.device_allocator(device).block_size(created.block), 1);
  });
}

ccalloc_status_t ccalloc_enable_peer_access(ccalloc_allocator_t* alloc, int device, int peer) {
  return guarded([&] { resolve(alloc).enable_peer_access(device, peer); });
}

ccalloc_status_t ccalloc_end_allocate_to_pool(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id) {
  return guarded([&] { resolve(alloc).end_allocate_to_pool(device, to_pool_id(id)); });
}

ccalloc_status_t ccalloc_pool_usage(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id,
                                    ccalloc_pool_usage_t* out) {
  return guarded([&] {
    require(out, "ccalloc_pool_usage", "out");
    const ccalloc::pool_usage u = resolve(alloc).get_pool_stats(device, to_pool_id(id));
    *out = ccalloc_pool_usage_t{u.segment_count,    u.reserved_bytes,   u.allocated_bytes,
                                u.active_bytes,     u.allocation_count, u.use_count};
  });
}

}  // extern "C"
