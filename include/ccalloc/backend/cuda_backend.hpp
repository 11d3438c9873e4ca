// ccalloc/backend/cuda_backend.hpp: the device backend for real NVIDIA GPUs.
//
// What it is: a device_backend over the CUDA runtime (cudaMalloc, streams,
// events) and, for virtual memory, the CUDA driver's cuMem* functions. The
// driver functions are looked up at run time through the runtime
// (cudaGetDriverEntryPointByVersion), so the library links only the CUDA
// runtime (libcudart), never libcuda directly; a machine without a driver
// gets a clean backend_error from the constructor instead of a loader error.
// This header includes no CUDA header: callers need no CUDA include paths.
//
// Handles: a stream_t holds a cudaStream_t value and an event_t a cudaEvent_t
// value (native_stream / from_native_stream below convert). stream_t 0 is
// (cudaStream_t)0, the legacy default stream of the device in question (this
// library is not compiled with --default-stream per-thread, so 0 means the
// legacy stream here even if the caller's own code uses per-thread default
// streams; pass cudaStreamPerThread's value, per_thread_stream_handle, for
// that stream). The allocator resolves cudaStreamPerThread on the calling
// thread (resolve_stream) into a handle of that thread's per-thread default
// stream, so each thread's stream has its own pool. CUDA offers no handle by
// which another thread could name that stream, so a resolved handle used on
// another thread falls back conservatively: record_event and wait_gate use
// the legacy default stream (which waits for all prior work of every
// blocking stream, the per-thread ones included), synchronize_stream waits
// for the whole device, is_capturing asks about the legacy stream. On its
// own thread it is exactly cudaStreamPerThread. Such a handle is never
// reused: blocks cached for the stream of a thread that ended stay in that
// stream's pool until the cache is released (empty_cache, or an
// allocation's out-of-memory path).
// Streams and events are bound to the device they were created on; pass that
// device with them.
//
// Devices: indices are CUDA runtime device ordinals in [0, device_count()),
// i.e. after CUDA_VISIBLE_DEVICES. Every function whose CUDA call depends on
// the current device (allocation, stream and event creation, recording,
// destruction, device synchronization, memory info, virtual memory) switches
// to `device` for the call when it is not current, and restores the caller's
// current device before returning (also when it throws): the backend never
// changes the caller's current device, except set_device. Queries and waits on
// events and non-default streams need no switch.
//
// Errors (the convention of device_backend): out of device memory is a return
// value (segment_malloc: nullptr, vm_create: false, vm_reserve: nullptr), and
// CUDA's error state is cleared (cudaGetLastError) so that the failed call
// does not surface later in unrelated code. Every other failure throws
// ccalloc::backend_error whose message names the CUDA call, its arguments,
// the error name and the error string, e.g.
// "cuda: cudaStreamCreateWithFlags(device 0) failed: cudaErrorInvalidDevice
// (invalid device ordinal)". Release functions called while the CUDA runtime
// is being unloaded at process exit (cudaErrorCudartUnloading) do nothing and
// do not throw: the driver reclaims everything then anyway.
//
// Thread safety: every function may be called from any thread concurrently
// (the CUDA runtime and driver are thread-safe; the backend's own state is set
// in the constructor and read-only afterwards, except caches guarded
// internally). The per-thread current device is the CUDA runtime's.
#pragma once

#include <ccalloc/backend/device_backend.hpp>
#include <memory>
#include <string>

namespace ccalloc {

class cuda_backend final : public device_backend {
 public:
  /// Counts the devices and looks up the driver's virtual-memory entry points
  /// (this starts the CUDA runtime and driver, but allocates nothing; device
  /// contexts are created by the first call that needs one). Throws
  /// backend_error if the CUDA runtime
  /// reports no usable device (no driver, driver too old, no GPU): the message
  /// names cudaGetDeviceCount's error.
  cuda_backend();
  ~cuda_backend() override;
  cuda_backend(const cuda_backend&) = delete;
  cuda_backend& operator=(const cuda_backend&) = delete;

  /// Number of CUDA devices the runtime sees, or 0 when it sees none or
  /// cannot start (no driver, old driver); never throws, clears CUDA's error
  /// state. Used by make_default_backend to choose a backend.
  [[nodiscard]] static int available_device_count() noexcept;

  /// Empty when the CUDA runtime library was loaded (it is opened on the
  /// first call of this, available_device_count or the constructor; see
  /// CCALLOC_CUDART_LIBRARY in docs/install.md), else why it could not be:
  /// "cuda: the CUDA runtime (<library>) could not be loaded: ...". Never
  /// throws beyond std::bad_alloc; thread-safe.
  [[nodiscard]] static std::string runtime_load_error();

  /// "cuda".
  [[nodiscard]] std::string name() const override { return "cuda"; }
  /// virtual_memory: the driver entry points resolved and every device
  /// reports CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED;
  /// peer_access: true; ipc: true (cudaIpc*); ipc_vm: virtual_memory, the
  /// export/import entry points resolved, and every device reports
  /// CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED; then
  /// vm_create asks for POSIX-fd-shareable memory (as PyTorch's expandable
  /// segments do), falling back to none where the driver refuses; gates: the driver's cuStreamWaitValue32
  /// resolved (the "v2" stream memory operations, on by default on every
  /// device since CUDA 11.7: no attribute to ask; the NOR attribute concerns
  /// only a wait flag gates do not use) and every device can map host memory
  /// (cudaDevAttrCanMapHostMemory).
  [[nodiscard]] backend_capabilities capabilities() const override;

  // --- devices -----------------------------------------------------------------

  /// Devices counted at construction (cudaGetDeviceCount), >= 1.
  [[nodiscard]] int device_count() const override;
  /// The calling thread's current device (cudaGetDevice). Throws backend_error.
  [[nodiscard]] int current_device() const override;
  /// cudaSetDevice. Throws backend_error for an index outside
  /// [0, device_count()) or a CUDA failure.
  void set_device(int device) override;
  /// Free and total bytes of `device` (cudaMemGetInfo on that device; creates
  /// its primary context if needed). Throws backend_error.
  [[nodiscard]] memory_info mem_get_info(int device) const override;

  // --- segments ------------------------------------------------------------------

  /// cudaMalloc of `size_bytes` (> 0) on `device`. CUDA documents 256-byte
  /// alignment; in practice its results are 512-byte aligned, and 2 MiB
  /// aligned for the segment sizes the allocator asks for (>= 2 MiB).
  /// Returns nullptr on cudaErrorMemoryAllocation (the error is cleared);
  /// throws backend_error for size 0, a bad device or any other CUDA error.
  [[nodiscard]] void* segment_malloc(int device, std::size_t size_bytes) override;
  /// cudaFree on `device` (synchronizes the device, as cudaFree does). Throws
  /// backend_error on a CUDA error (an unknown pointer: cudaErrorInvalidValue).
  void segment_free(int device, void* ptr) override;

  // --- streams and events -----------------------------------------------------------

  /// cudaStreamCreateWithFlags(cudaStreamNonBlocking) on `device`: the stream
  /// does not synchronize with the legacy default stream. The caller destroys
  /// it with destroy_stream. Throws backend_error.
  [[nodiscard]] stream_t create_stream(int device) override;
  /// cudaStreamDestroy. Throws backend_error for a default stream (0,
  /// cudaStreamLegacy, cudaStreamPerThread or a resolved per-thread stream:
  /// they cannot be destroyed) or a CUDA error. Work queued on the stream still
  /// completes (CUDA's semantics).
  void destroy_stream(int device, stream_t stream) override;
  /// cudaEventCreateWithFlags(cudaEventDisableTiming) on `device`. Never
  /// returns 0. Throws backend_error.
  [[nodiscard]] event_t create_event(int device) override;
  /// cudaEventDestroy. Throws backend_error for event 0 or a CUDA error.
  void destroy_event(int device, event_t event) override;
  /// cudaEventRecord(event, stream); stream 0 is `device`'s legacy default
  /// stream. `event` and `stream` must belong to `device`. Throws backend_error.
  void record_event(int device, event_t event, stream_t stream) override;
  /// cudaEventQuery: true when complete, false on cudaErrorNotReady (cleared),
  /// never blocks. An event never recorded counts as complete. Throws
  /// backend_error on any other error (including a failed kernel reported
  /// through the event).
  [[nodiscard]] bool query_event(int device, event_t event) override;
  /// cudaEventSynchronize. Throws backend_error.
  void synchronize_event(int device, event_t event) override;
  /// cudaStreamWaitEvent(stream, event, 0) with `device` current; stream 0
  /// is `device`'s legacy default stream. Throws backend_error on failure,
  /// and for another thread's per-thread default stream (CUDA cannot name
  /// it from here; waiting on another stream instead would not order it).
  void stream_wait_event(int device, stream_t stream, event_t event) override;
  /// Whether `stream` is a live stream of `device`: the default streams
  /// (0, legacy_stream_handle, per_thread_stream_handle) and the calling
  /// thread's resolved per-thread stream are; another thread's resolved
  /// per-thread stream is not (no thread can name it); any other handle is
  /// when cudaStreamGetDevice says it belongs to `device` (with a runtime
  /// older than 12.8, which lacks that call: when cudaStreamGetFlags accepts
  /// it, whatever its device). A handle the driver reports invalid
  /// (cudaErrorInvalidResourceHandle, cudaErrorInvalidValue,
  /// cudaErrorContextIsDestroyed) is not, and the error is cleared. CUDA
  /// calls a handle never created, or already destroyed, undefined: the
  /// driver reports most such handles invalid but does not promise to, so
  /// this is as far as CUDA can tell. Throws backend_error for a device out
  /// of range and for any other CUDA error (a sticky one from earlier work).
  [[nodiscard]] bool is_stream(int device, stream_t stream) override;
  /// cudaStreamSynchronize; stream 0 is `device`'s legacy default stream (which
  /// also waits for the device's blocking streams). Throws backend_error.
  void synchronize_stream(int device, stream_t stream) override;
  /// cudaDeviceSynchronize on `device`. Throws backend_error.
  void synchronize_device(int device) override;
  /// cudaStreamIsCapturing: true while `stream` captures a graph (also
  /// while its capture was invalidated and not yet ended).
  [[nodiscard]] bool is_capturing(int device, stream_t stream) override;

  // --- virtual memory (driver entry points; capabilities().virtual_memory) ------------
  //
  // All sizes and addresses in bytes; `size_bytes` and addresses are
  // multiples of vm_granularity(device). Each throws backend_error naming
  // the driver call and its CUresult (cuGetErrorName / cuGetErrorString) on
  // failure, and backend_error("... not supported ...") when
  // capabilities().virtual_memory is false.

  /// cuMemGetAllocationGranularity (minimum granularity) for pinned device
  /// memory on `device`: 2 MiB on current GPUs. Cached per device.
  [[nodiscard]] std::size_t vm_granularity(int device) const override;
  /// cuMemAddressReserve of `size_bytes` of device address space (no
  /// backing). Returns nullptr on CUDA_ERROR_OUT_OF_MEMORY.
  [[nodiscard]] void* vm_reserve(int device, std::size_t size_bytes) override;
  /// cuMemAddressFree of a whole reservation from vm_reserve (unmapped).
  void vm_release(int device, void* base, std::size_t size_bytes) override;
  /// cuMemCreate of `size_bytes` of pinned physical memory on `device`;
  /// writes the handle (a CUmemGenericAllocationHandle) to *handle. Returns
  /// false on CUDA_ERROR_OUT_OF_MEMORY (*handle untouched).
  [[nodiscard]] bool vm_create(int device, std::size_t size_bytes, physical_handle_t* handle) override;
  /// cuMemRelease of a handle from vm_create. The memory is freed once it is
  /// also unmapped everywhere.
  void vm_release_handle(int device, physical_handle_t handle) override;
  /// cuMemMap of `handle` (offset 0) at `addr`, then cuMemSetAccess granting
  /// `device` read/write. If granting access fails the range is unmapped
  /// again before the error is thrown.
  void vm_map(int device, void* addr, std::size_t size_bytes, physical_handle_t handle) override;
  /// cuMemUnmap of a range mapped with vm_map. Like cudaFree, the caller must
  /// make sure no queued work still uses the range.
  void vm_unmap(int device, void* addr, std::size_t size_bytes) override;
  /// cuMemSetAccess granting `peer` read/write to a mapped range of `device`.
  void vm_set_access(int device, void* addr, std::size_t size_bytes, int peer) override;

  // --- inter-process sharing ---------------------------------------------------------

  /// cudaIpcGetMemHandle(base) on `device`.
  [[nodiscard]] ipc_mem_handle ipc_export_segment(int device, void* base) override;
  /// cudaIpcOpenMemHandle(cudaIpcMemLazyEnablePeerAccess) on `device`.
  [[nodiscard]] void* ipc_open_segment(int device, const ipc_mem_handle& handle) override;
  /// cudaIpcCloseMemHandle on `device`.
  void ipc_close_segment(int device, void* ptr) override;
  /// cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR): returns {fd, 0, 0}
  /// (the size is not known here; the caller knows it).
  [[nodiscard]] shareable_handle vm_export_handle(int device, physical_handle_t handle) override;
  /// cuMemImportFromShareableHandle(POSIX_FILE_DESCRIPTOR); offset must be 0.
  [[nodiscard]] physical_handle_t vm_import_handle(int device, const shareable_handle& shared) override;

  // --- copies --------------------------------------------------------------------------

  /// cudaMemcpyAsync(cudaMemcpyDeviceToDevice) with `device` current.
  void memcpy_async(int device, void* dst, const void* src, std::size_t size_bytes, stream_t stream) override;
  /// cudaMemcpyPeerAsync.
  void memcpy_peer_async(void* dst, int dst_device, const void* src, int src_device, std::size_t size_bytes,
                         stream_t stream) override;
  /// cudaMemcpy(cudaMemcpyDeviceToDevice) with `device` current.
  void copy_data(int device, void* dst, const void* src, std::size_t size_bytes) override;
  /// cudaHostAlloc (cudaHostAllocPortable) / cudaFreeHost; copies are
  /// cudaMemcpyAsync DeviceToHost / HostToDevice on the stream.
  [[nodiscard]] void* host_alloc(int device, std::size_t size_bytes) override;
  void host_free(int device, void* ptr) noexcept override;
  void copy_to_host_async(int device, void* host_dst, const void* device_src, std::size_t size_bytes,
                          stream_t stream) override;
  void copy_from_host_async(int device, void* device_dst, const void* host_src, std::size_t size_bytes,
                            stream_t stream) override;

  // --- peers ------------------------------------------------------------------------

  /// cudaDeviceCanAccessPeer(device, peer). False when device == peer. Throws
  /// backend_error for indices out of range.
  [[nodiscard]] bool can_access_peer(int device, int peer) const override;
  /// cudaDeviceEnablePeerAccess(peer) made on `device`, so that `device` can
  /// access `peer`'s cudaMalloc memory. Enabling it twice is not an error
  /// (cudaErrorPeerAccessAlreadyEnabled is cleared). Throws backend_error.
  void enable_peer_access(int device, int peer) override;

  // --- gates (capabilities().gates; see device_backend) -----------------------------
  //
  // A gate is a 32-bit word in pinned, device-mapped host memory
  // (cudaHostAlloc with cudaHostAllocMapped | cudaHostAllocPortable), 0 while
  // closed, 1 once open; the handle is the word's host address. Words come
  // from 4 KiB blocks of 1024 allocated on demand per device and are reused
  // through a free list; the blocks are freed (cudaFreeHost) when the backend
  // is destroyed. Each throws backend_error("... not supported ...") when
  // capabilities().gates is false, and backend_error for an unknown gate or
  // one of another device.

  /// A closed gate (its word set to 0) from the free list of `device`, or
  /// from a new block (cudaHostAlloc + cudaHostGetDevicePointer on `device`).
  /// Allocate gates before closing any: allocating pinned memory may wait for
  /// the device.
  [[nodiscard]] gate_t create_gate(int device) override;
  /// cuStreamWaitValue32(stream, word, 1, CU_STREAM_WAIT_VALUE_GEQ) on
  /// `device` (stream 0: its legacy default stream).
  void wait_gate(int device, stream_t stream, gate_t gate) override;
  /// Stores 1 into the gate's word (atomic, release order). Never blocks, no
  /// CUDA call: safe from any thread, also while another is blocked on the gate.
  void open_gate(int device, gate_t gate) override;
  /// Returns the gate to the free list. Throws backend_error if it is still
  /// closed (its word is not 1).
  void destroy_gate(int device, gate_t gate) override;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

/// The cudaStream_t (as void*) that a stream_t of the CUDA backend holds.
[[nodiscard]] inline void* native_stream(stream_t stream) noexcept {
  return reinterpret_cast<void*>(stream);  // NOLINT(performance-no-int-to-ptr)
}
/// The stream_t for a cudaStream_t (pass the stream itself: it is a pointer).
[[nodiscard]] inline stream_t from_native_stream(const void* stream) noexcept {
  return reinterpret_cast<stream_t>(stream);
}

}  // namespace ccalloc
