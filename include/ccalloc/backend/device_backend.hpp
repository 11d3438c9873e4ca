// ccalloc/backend/device_backend.hpp: the contract between the allocator and a
// device.
//
// The device caching allocator talks to a device only through this interface.
// Two implementations ship: ccalloc::cuda_backend (real GPUs, CUDA runtime and
// driver entry points) and ccalloc::sim_backend (a simulated device in host
// memory with a virtual clock; the default for replay and for every test).
//
// Error convention (one for every function): a function that can run out of
// device memory says so in its return value (segment_malloc returns nullptr);
// every other failure throws ccalloc::backend_error with the failing call and
// its reason. Functions marked "optional" have a default implementation that
// throws backend_error("... not supported by <name>"); capabilities() tells
// which are implemented.
//
// Thread safety: every function may be called from any thread concurrently;
// implementations synchronize internally. Devices are indices in
// [0, device_count()). Stream and event handles are the backend's; a handle
// is bound to the device it was created on.
#pragma once

#include <ccalloc/base/types.hpp>

#include <cstddef>
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace ccalloc {

/// Free and total bytes of one device, as cudaMemGetInfo reports them.
struct memory_info {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
};

/// What a backend implements beyond the required functions.
struct backend_capabilities {
  bool virtual_memory = false;  ///< vm_* functions (expandable segments, SPEC B7)
  bool peer_access = false;     ///< enable_peer_access / can_access_peer
  bool ipc = false;             ///< ipc_export_segment / ipc_open_segment / ipc_close_segment (plain segments)
  bool ipc_vm = false;          ///< vm_export_handle / vm_import_handle (expandable segments; needs virtual_memory)
  bool gates = false;           ///< create_gate / wait_gate / open_gate / destroy_gate
  bool stream_wait = false;     ///< stream_wait_event (cudaStreamWaitEvent)
};

/// An opaque physical-memory handle from vm_create (CUmemGenericAllocationHandle).
using physical_handle_t = std::uint64_t;

/// The 64 bytes of a cudaIpcMemHandle_t: names a plain segment to other
/// processes (cudaIpcGetMemHandle).
struct ipc_mem_handle {
  std::array<std::uint8_t, 64> bytes{};
};

/// Physical memory exported as a POSIX file descriptor
/// (cuMemExportToShareableHandle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR).
/// The memory is the range [offset_bytes, offset_bytes + size_bytes) of the
/// file `fd` refers to; offset_bytes is 0 on CUDA and the page's place in the
/// device memory file on the simulated device.
struct shareable_handle {
  int fd = -1;
  std::uint64_t offset_bytes = 0;
  std::size_t size_bytes = 0;
};

/// An opaque host-controlled gate from create_gate; never 0.
using gate_t = std::uintptr_t;

class device_backend {
 public:
  virtual ~device_backend() = default;

  /// Short name for messages ("cuda", "sim").
  [[nodiscard]] virtual std::string name() const = 0;
  [[nodiscard]] virtual backend_capabilities capabilities() const { return {}; }

  /// The host's time in microseconds, for the allocator's time budgets
  /// (allocator_config::recycle_time_percent): only differences matter.
  /// std::nullopt: this backend has no clock and the budgets do not apply
  /// (recycle_time_percent:0, which needs no clock, still means never).
  /// The default reads std::chrono::steady_clock (a real GPU: the time the
  /// program really spends). The simulated device and the replay on a GPU
  /// return a modelled clock (host_clock.hpp). Thread safety: callable from
  /// any thread.
  [[nodiscard]] virtual std::optional<std::uint64_t> host_time_us() const;

  // --- devices -------------------------------------------------------------

  /// Number of devices this backend drives (>= 1 for a usable backend).
  [[nodiscard]] virtual int device_count() const = 0;
  /// The calling thread's current device (cudaGetDevice).
  [[nodiscard]] virtual int current_device() const = 0;
  /// Sets the calling thread's current device (cudaSetDevice). Throws
  /// backend_error for an index outside [0, device_count()).
  virtual void set_device(int device) = 0;
  /// Free and total bytes of `device` (cudaMemGetInfo).
  [[nodiscard]] virtual memory_info mem_get_info(int device) const = 0;

  // --- segments --------------------------------------------------------------

  /// Obtains `size_bytes` (> 0) of device memory on `device` (cudaMalloc).
  /// The result is aligned to at least 512 bytes. Returns nullptr when the
  /// device is out of memory; throws backend_error on any other failure. The
  /// memory is not zeroed. Ownership passes to the caller, who returns it with
  /// segment_free on the same device.
  [[nodiscard]] virtual void* segment_malloc(int device, std::size_t size_bytes) = 0;
  /// Returns memory from segment_malloc (cudaFree). Implicitly synchronizes the
  /// device, as cudaFree does: returns only once all work queued on every
  /// stream of `device` before the call has completed (events recorded
  /// before it have completed then). `ptr` must be a pointer segment_malloc
  /// returned on `device` and not yet freed; anything else throws
  /// backend_error.
  virtual void segment_free(int device, void* ptr) = 0;

  // --- streams and events ------------------------------------------------------
  //
  // Every function taking a stream also accepts the special handles
  // legacy_stream_handle (cudaStreamLegacy) and per_thread_stream_handle
  // (cudaStreamPerThread), meaning the stream they stand for on the calling
  // thread, and the handles resolve_stream returns, on any thread.

  /// The handle of the stream `stream` stands for when called on this thread
  /// (SPEC F2, NVIDIA/cub#373): legacy_stream_handle gives default_stream
  /// (the legacy default stream); per_thread_stream_handle gives a handle of
  /// the calling thread's per-thread default stream of `device`: the same
  /// value on every call of one thread, a different one on each thread, never
  /// a value create_stream returns (the top bit is set; is_per_thread_stream
  /// tells), never reused after the thread ends. Any other handle comes back
  /// unchanged. The allocator resolves every stream it is given before it
  /// keys pools or events by it, so that two threads' per-thread streams
  /// never share a pool. Throws backend_error for a device out of range.
  /// Not optional; the default implementation is right for every backend
  /// whose streams are CUDA's handle values or counters below 2^63.
  [[nodiscard]] virtual stream_t resolve_stream(int device, stream_t stream) const;
  /// True for a handle resolve_stream returned for a per-thread default stream.
  [[nodiscard]] static bool is_per_thread_stream(stream_t stream) noexcept;
  /// True when `stream` is the calling thread's own per-thread default stream
  /// (a resolve_stream result of this thread).
  [[nodiscard]] static bool is_calling_thread_stream(stream_t stream) noexcept;

  /// Creates a stream on `device` (cudaStreamCreateWithFlags, non-blocking).
  [[nodiscard]] virtual stream_t create_stream(int device) = 0;
  virtual void destroy_stream(int device, stream_t stream) = 0;
  /// Whether `stream` (a resolve_stream result) is a live stream of
  /// `device`, as far as the backend can tell: the allocator asks the first
  /// time it meets a stream, and again after destroy_stream through it (a
  /// handle never created would fail at its free), never per allocation (a
  /// backend call on the hot path). The default says true. The simulated
  /// device knows its streams; CUDA's asks cudaStreamGetDevice, which
  /// refuses another device's stream and most invalid handles (a handle no
  /// one created or one destroyed is undefined for CUDA). Thread-safe;
  /// throws backend_error for a bad device.
  [[nodiscard]] virtual bool is_stream(int device, stream_t stream);
  /// Creates an event on `device` with timing disabled (cudaEventDisableTiming).
  [[nodiscard]] virtual event_t create_event(int device) = 0;
  virtual void destroy_event(int device, event_t event) = 0;
  /// Records `event` on `stream`: it completes when the work queued on
  /// `stream` before this call has completed (cudaEventRecord).
  virtual void record_event(int device, event_t event, stream_t stream) = 0;
  /// True when `event` has completed (cudaEventQuery), never blocks.
  [[nodiscard]] virtual bool query_event(int device, event_t event) = 0;
  /// Blocks until `event` has completed (cudaEventSynchronize).
  virtual void synchronize_event(int device, event_t event) = 0;
  /// Makes the work queued on `stream` of `device` after this call wait on
  /// the device until `event` (of `device`) has completed, as recorded at
  /// the time of this call: a later record_event of `event` does not change
  /// what the stream waits for (cudaStreamWaitEvent). Never blocks the host.
  /// An event never recorded is complete: nothing waits. Not allowed while a
  /// stream of `device` captures a graph (it would become a graph
  /// dependency); the allocator never calls it then. Throws backend_error on
  /// failure (a bad handle, or a per-thread default stream of another thread
  /// on CUDA, which cannot be named there). Optional
  /// (capabilities().stream_wait): the default throws "not supported".
  /// Thread safety: callable from any thread.
  virtual void stream_wait_event(int device, stream_t stream, event_t event);
  /// Blocks until all work on `stream` has completed (cudaStreamSynchronize).
  virtual void synchronize_stream(int device, stream_t stream) = 0;
  /// Blocks until all work on `device` has completed (cudaDeviceSynchronize).
  virtual void synchronize_device(int device) = 0;
  /// True while `stream` of `device` is capturing a CUDA graph
  /// (cudaStreamIsCapturing). While any stream captures (CUDA's default,
  /// global capture mode) the allocator must not query or wait for events,
  /// synchronize, or free device memory. Optional: the default says false.
  [[nodiscard]] virtual bool is_capturing(int device, stream_t stream);

  // --- virtual memory (optional; expandable segments, SPEC B7) ---------------

  /// Page size for physical mappings on `device` (cuMemGetAllocationGranularity),
  /// in bytes; 2 MiB on current NVIDIA GPUs.
  [[nodiscard]] virtual std::size_t vm_granularity(int device) const;
  /// Reserves `size_bytes` (a multiple of vm_granularity) of address space
  /// without backing (cuMemAddressReserve). Returns nullptr if the address
  /// space is exhausted.
  [[nodiscard]] virtual void* vm_reserve(int device, std::size_t size_bytes);
  /// Releases a reservation from vm_reserve; all of it must be unmapped.
  virtual void vm_release(int device, void* base, std::size_t size_bytes);
  /// Creates `size_bytes` (a multiple of vm_granularity) of physical memory
  /// (cuMemCreate). Returns false when the device is out of memory.
  [[nodiscard]] virtual bool vm_create(int device, std::size_t size_bytes, physical_handle_t* handle);
  /// Releases physical memory from vm_create (cuMemRelease); it must be unmapped.
  virtual void vm_release_handle(int device, physical_handle_t handle);
  /// Maps `handle` at `addr` (inside a reservation, granularity-aligned) and
  /// grants `device` read/write access (cuMemMap + cuMemSetAccess).
  virtual void vm_map(int device, void* addr, std::size_t size_bytes, physical_handle_t handle);
  /// Unmaps a range mapped with vm_map (cuMemUnmap).
  virtual void vm_unmap(int device, void* addr, std::size_t size_bytes);
  /// Grants `peer` access to a mapped range of `device` (cuMemSetAccess).
  virtual void vm_set_access(int device, void* addr, std::size_t size_bytes, int peer);

  // --- inter-process sharing (optional; SPEC F25) ----------------------------
  //
  // Plain segments (capabilities().ipc; cudaIpc*): the producer exports a
  // segment_malloc result; another process opens it and gets its own
  // address for the same memory. A process cannot open its own export on
  // CUDA (cudaErrorDeviceUninitialized / invalid context).

  /// The IPC handle of `base`, a live segment_malloc result of `device`
  /// (cudaIpcGetMemHandle). Throws backend_error naming the pointer otherwise.
  [[nodiscard]] virtual ipc_mem_handle ipc_export_segment(int device, void* base);
  /// Maps the segment named by `handle` (exported by another process) into
  /// this process for `device` and returns its base address there
  /// (cudaIpcOpenMemHandle with cudaIpcMemLazyEnablePeerAccess). Each
  /// successful call must be paired with ipc_close_segment. Throws
  /// backend_error when the handle is not valid here (its segment was freed,
  /// it came from this process, another device).
  [[nodiscard]] virtual void* ipc_open_segment(int device, const ipc_mem_handle& handle);
  /// Unmaps a segment from ipc_open_segment (cudaIpcCloseMemHandle).
  virtual void ipc_close_segment(int device, void* ptr);

  // Expandable segments (capabilities().ipc_vm): physical handles from
  // vm_create are exported as file descriptors; a consumer imports them and
  // maps them with vm_reserve / vm_map / vm_set_access like its own handles.
  // On CUDA this needs the handles to be created shareable as POSIX file
  // descriptors (CUmemAllocationProp::requestedHandleTypes), which
  // cuda_backend does for every vm_create when ipc_vm is true.

  /// Exports `handle` (a live vm_create handle of `device`) as a file
  /// descriptor (cuMemExportToShareableHandle). The caller owns the returned
  /// fd (close it after sending it). Throws backend_error.
  [[nodiscard]] virtual shareable_handle vm_export_handle(int device, physical_handle_t handle);
  /// Imports exported memory (cuMemImportFromShareableHandle) as a physical
  /// handle of `device` that vm_map accepts; release it with
  /// vm_release_handle. `shared.fd` stays the caller's (close it after the
  /// call). Imported handles do not draw on this process's device capacity.
  /// Throws backend_error for a bad descriptor or range.
  [[nodiscard]] virtual physical_handle_t vm_import_handle(int device, const shareable_handle& shared);

  // --- copies (optional; SPEC F27, F28) --------------------------------------

  /// Queues a copy of `size_bytes` from `src` to `dst` on `stream` of
  /// `device` (cudaMemcpyAsync, cudaMemcpyDeviceToDevice; unified addressing
  /// finds both devices). Right for memory from plain device allocations, or
  /// when the peers have access to each other. Size 0 does nothing.
  virtual void memcpy_async(int device, void* dst, const void* src, std::size_t size_bytes, stream_t stream);
  /// Queues a copy from `src` on `src_device` to `dst` on `dst_device` on
  /// `stream` (cudaMemcpyPeerAsync; the stream may be of either device).
  /// Works without peer access and for memory mapped with cuMemMap, which
  /// cudaMemcpyAsync cannot copy across devices without peer access. Size 0
  /// does nothing.
  virtual void memcpy_peer_async(void* dst, int dst_device, const void* src, int src_device, std::size_t size_bytes,
                                 stream_t stream);
  /// Copies `size_bytes` from `src` to `dst` on `device` and returns when
  /// done (cudaMemcpy, cudaMemcpyDeviceToDevice). Size 0 does nothing.
  virtual void copy_data(int device, void* dst, const void* src, std::size_t size_bytes);

  // --- host memory and host copies (optional; sleep and wake, SPEC S2-S3) ----

  /// Allocates `size_bytes` of host memory for copies with `device`: pinned
  /// (page-locked, cudaHostAlloc) on a GPU, so that the copies below run at
  /// the bus's speed; nullptr when the host has none (never throws for lack
  /// of memory). Free it with host_free. Size 0 returns nullptr. Default:
  /// std::malloc (pageable memory). Thread safe.
  [[nodiscard]] virtual void* host_alloc(int device, std::size_t size_bytes);
  /// Frees memory from host_alloc (nullptr: nothing). The copies that use it
  /// must have completed. Never throws.
  virtual void host_free(int device, void* ptr) noexcept;
  /// Queues a copy of `size_bytes` from device memory `device_src` of
  /// `device` to host memory `host_dst` (from host_alloc) on `stream`
  /// (cudaMemcpyAsync, cudaMemcpyDeviceToHost); the host may read `host_dst`
  /// once an event recorded on `stream` after it completes. Size 0 does
  /// nothing. Default: a synchronous memmove (host-addressable devices).
  virtual void copy_to_host_async(int device, void* host_dst, const void* device_src, std::size_t size_bytes,
                                  stream_t stream);
  /// The other way (cudaMemcpyHostToDevice): work queued on `stream` after
  /// it sees the bytes; `host_src` must stay until it has completed.
  virtual void copy_from_host_async(int device, void* device_dst, const void* host_src, std::size_t size_bytes,
                                    stream_t stream);

  // --- peers (optional) -----------------------------------------------------

  [[nodiscard]] virtual bool can_access_peer(int device, int peer) const;
  virtual void enable_peer_access(int device, int peer);

  // --- gates (optional; replay on a real device, SPEC X8) ---------------------
  //
  // A gate is a one-shot flag that the host opens: stream work queued behind
  // wait_gate does not start until the host calls open_gate. `ccalloc replay
  // --device cuda` holds a block in use on a side stream with one during a
  // trace's free_requested .. free_completed gap. Deadlock warning: while a
  // gate is closed, a host call that waits for work behind it (synchronizing
  // the waiting stream, an event recorded on it after the wait, or the whole
  // device; on CUDA also cudaFree, which waits for the whole device) returns
  // only once another thread opens the gate.

  /// Creates a closed gate for streams of `device`. Never returns 0. A handle
  /// may be returned again after destroy_gate.
  [[nodiscard]] virtual gate_t create_gate(int device);
  /// Work queued on `stream` (of `device`) after this call does not start
  /// until `gate` (of `device`) is opened; nothing waits if it is open already.
  /// Never blocks the host.
  virtual void wait_gate(int device, stream_t stream, gate_t gate);
  /// Opens `gate`: the streams waiting on it proceed. Opening an open gate does
  /// nothing. Never blocks; may be called from any thread, also while another
  /// thread is blocked in a call that waits for the gate.
  virtual void open_gate(int device, gate_t gate);
  /// Releases a gate from create_gate. The gate must be open and no stream may
  /// still be waiting on it (synchronize the streams that waited on it first:
  /// the handle may come back from a later create_gate, closed again).
  virtual void destroy_gate(int device, gate_t gate);

 protected:
  [[noreturn]] void throw_not_supported(const char* what) const;
};

}  // namespace ccalloc
