// ccalloc/frontend/caching_allocator.hpp: the multi-device caching allocator
// (PyTorch's NativeCachingAllocator).
//
// What it is: the object callers use. It owns one device_caching_allocator
// per device, maps each pointer it handed out to its block, and keeps the
// calling thread's current stream. Use one instance per process and backend
// (ccalloc's C API and Python package hold one); tests make their own.
//
// Names: functions are snake_case; each doc comment gives PyTorch's camelCase
// name where it differs (recordStream -> record_stream).
//
// Guarantees: a pointer from malloc is aligned to 512 bytes and safe to use on
// the stream it was allocated on at once; it stays valid until free. After an
// exception the allocator is unchanged and usable. Pointer lookup is sharded
// (no lock shared by all threads on free), per-device state is per device.
//
// Streams: a stream that memory was allocated on must stay valid (not
// destroyed) while the allocator caches memory of it, i.e. until
// empty_cache() or the allocator's end, as PyTorch assumes (its streams come
// from a pool and live as long as the process): before pages freed on a
// stream change hands, the allocator records an event on that stream (a
// page fence) and takes them once it has completed, without blocking.
//
// Thread safety: every function may be called from any thread concurrently,
// except init(), which must not race with other calls.
//
// Fork: fork() may come while other threads are inside any call. The
// allocator registers with process-wide pthread_atfork handlers
// (base/detail/fork_handlers.hpp) from its constructor to its destructor:
// they take every lock of every live allocator, its devices and backend
// before the fork, in the library's lock order, and release them after it,
// so a child's allocators work at once and hold what the parent's held
// between two calls. A fork waits for the calls under way; constructing or
// destroying an allocator waits for a fork under way. The simulated
// device's child has its own copy of the device memory (sim_backend.hpp); a
// CUDA child cannot use CUDA (its device calls throw backend_error saying
// so). A fork from a callback run under a device's locks (a mapping
// listener, a pool's segment allocator) takes no lock (docs/limitations.md).
#pragma once

#include <ccalloc/backend/device_backend.hpp>
#include <ccalloc/base/detail/fork_handlers.hpp>
#include <ccalloc/base/detail/pointer_map.hpp>
#include <ccalloc/base/detail/spin_mutex.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/base/types.hpp>
#include <ccalloc/core/config.hpp>
#include <ccalloc/core/device_caching_allocator.hpp>
#include <ccalloc/core/history.hpp>
#include <ccalloc/core/snapshot.hpp>
#include <ccalloc/core/stats.hpp>

#include <array>
#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ccalloc {

class caching_allocator;
namespace detail {
struct ipc_cache;
struct ipc_exports;
}  // namespace detail

/// What share_ipc_handle returns (SPEC F25).
struct ipc_export {
  /// The handle's bytes (include/ccalloc/frontend/ipc_handle.hpp): binary,
  /// may contain NUL bytes; send them as they are.
  std::string handle;
  /// File descriptors the other process needs, in order (expandable
  /// segments: one per page; empty for plain segments). The caller owns them:
  /// send them over a Unix socket with SCM_RIGHTS (or let the other process
  /// take them with pidfd_getfd), then close them here.
  std::vector<int> fds;
};

/// One exported expandable block, as ipc_exports() reports it (SPEC C3).
struct ipc_export_info {
  void* ptr = nullptr;         ///< the block's pointer in this process
  int device = 0;
  std::size_t size_bytes = 0;  ///< the block's size
  /// Live processes that have the range open now (slots of the lease held
  /// by running processes; a process that ended without closing is not
  /// counted and its slot is freed by this call).
  std::size_t importers = 0;
  /// True when free() came while importers held the block: it stays
  /// allocated (its pages mapped and counted as allocated) until they are gone.
  bool owner_freed = false;
};

/// Deleter of the owning handle returned by allocate(): frees through the
/// allocator that made it (which must outlive the handle).
struct data_ptr_deleter {
  caching_allocator* owner = nullptr;
  void operator()(void* ptr) const;
};
/// Owning handle to device memory (PyTorch's DataPtr, without the device).
using data_ptr = std::unique_ptr<void, data_ptr_deleter>;
/// Signature of raw_deleter(): frees a pointer of the global allocator.
using raw_deleter_fn = void (*)(void*);

class caching_allocator {
 public:
  /// `backend` is shared with whoever created it. The configuration comes
  /// from the environment: CCALLOC_CONF (SPEC F30), and CCALLOC_NO_CACHING=1
  /// (or true/yes/on) starts in no-caching mode (SPEC F6). Warnings about settings without
  /// effect (SPEC X6) go to stderr, one line each: "ccalloc: warning: <warning>". Throws config_error for a bad CCALLOC_CONF
  /// or a CCALLOC_NO_CACHING that is not a boolean.
  explicit caching_allocator(std::shared_ptr<device_backend> backend);
  /// Uses `config` as given and reads no environment variable (for tools and
  /// tests that must not depend on the caller's environment, e.g. replay).
  caching_allocator(std::shared_ptr<device_backend> backend, allocator_config config);
  ~caching_allocator();
  caching_allocator(const caching_allocator&) = delete;
  caching_allocator& operator=(const caching_allocator&) = delete;

  /// Creates the per-device allocators for devices [0, device_count) (F1).
  /// Throws invalid_argument_error if device_count < 1 or exceeds the
  /// backend's device count. Calling it again with the same count is a no-op;
  /// a larger count adds devices.
  void init(int device_count);
  [[nodiscard]] bool initialized() const noexcept;
  /// The devices init() created: [0, initialized_device_count()); 0 before
  /// init(). Thread-safe against everything but a concurrent init().
  [[nodiscard]] int initialized_device_count() const noexcept { return static_cast<int>(devices_.size()); }
  /// "ccalloc" (PyTorch: name(), F29).
  [[nodiscard]] std::string name() const { return "ccalloc"; }
  [[nodiscard]] device_backend& backend() const noexcept { return *backend_; }

  /// Allocates `size_bytes` on `device` for use on `stream` (F2); the
  /// special handles legacy_stream_handle and per_thread_stream_handle
  /// (cudaStreamLegacy, cudaStreamPerThread) mean the stream they stand for
  /// on the calling thread (device_backend::resolve_stream): each thread's
  /// per-thread default stream has its own pool, forgotten after the thread
  /// exits as destroy_stream forgets a stream (the device's next world lock,
  /// a slow-path malloc or a statistics read, waits for that stream's work
  /// first: the whole device's on CUDA). Size 0
  /// returns nullptr. Throws invalid_argument_error for an uninitialized
  /// allocator, a device out of range, or a stream that is not a live stream
  /// of the device (destroyed by destroy_stream; never created, where the
  /// backend can tell: device_backend::is_stream), out_of_memory_error when the device
  /// cannot provide the memory (at once for sizes >= 1 EiB); with the
  /// setting oom_snapshot, that error first writes the device's snapshot to
  /// its file, unlocked, on the calling thread (docs/memory-history.md).
  [[nodiscard]] void* malloc(int device, std::size_t size_bytes, stream_t stream);
  /// Frees a pointer from this allocator (F3). nullptr is a no-op. Throws
  /// invalid_argument_error naming the pointer if it is unknown (never
  /// allocated here, freed already, or interior), and backend_error when the
  /// device fails (recording the events of a block used on other streams, or
  /// returning the segment in no-caching mode, or recording a page fence);
  /// nothing changes then and the pointer stays live (docs/errors.md).
  /// Stream lifetime: the block's stream must exist when it is freed (free
  /// may record an event on it: a page fence, docs/design.md); once every
  /// block of a stream is freed the stream may be destroyed, and the
  /// allocator never uses it again (its cached memory still serves other
  /// streams). Thread safety: any thread.
  void free(void* ptr);

  /// Allocates on the current device and the calling thread's current stream
  /// and returns an owning handle (F4). Size 0 gives an empty handle.
  [[nodiscard]] data_ptr allocate(std::size_t size_bytes);
  /// A plain function that frees pointers of the process-wide allocator
  /// (ccalloc::global_allocator()), for C-style owners (PyTorch: raw_deleter).
  [[nodiscard]] static raw_deleter_fn raw_deleter() noexcept;
  /// malloc on the current device and the thread's current stream (F5).
  [[nodiscard]] void* raw_alloc(std::size_t size_bytes);
  /// malloc on the current device and `stream` (PyTorch: raw_alloc_with_stream).
  [[nodiscard]] void* raw_alloc_with_stream(std::size_t size_bytes, stream_t stream);
  /// free (PyTorch: raw_delete).
  void raw_delete(void* ptr);

  /// The calling thread's current stream for allocate/raw_alloc (default 0).
  static void set_current_stream(stream_t stream) noexcept;
  [[nodiscard]] static stream_t current_stream() noexcept;

  /// Turns caching on or off for every device (F6). Off = no-caching mode:
  /// each allocation goes straight to the device and back; turning it off
  /// releases the cache. (PyTorch: enable / isEnabled.) Throws backend_error
  /// if a device fails to take its cache back; then no device changes mode.
  void enable(bool enabled);
  [[nodiscard]] bool is_enabled() const noexcept;

  /// Caps `device`'s reserved bytes at fraction x total (F7; PyTorch:
  /// setMemoryFraction). A cap below the reserved bytes returns the cache
  /// first. Throws invalid_argument_error for a fraction outside [0, 1] or a
  /// bad device, and backend_error if returning the cache fails; the old
  /// fraction stays then.
  void set_memory_fraction(double fraction, int device);
  [[nodiscard]] double get_memory_fraction(int device) const;

  /// Returns every unused cached segment of every device to the device (F8;
  /// PyTorch: emptyCache). A device or segment free that fails does not stop
  /// it: every other segment of every device goes back, the failing
  /// segments stay cached, and the first failure is thrown afterwards
  /// (backend_error; PyTorch stops at the first).
  void empty_cache();
  /// Largest cached free block of `device`, in bytes (F9; PyTorch: cacheInfo).
  [[nodiscard]] std::size_t cache_info(int device) const;
  /// Base address and size (bytes) of the segment holding `ptr`, which must be
  /// a pointer this allocator returned (F10; PyTorch: getBaseAllocation).
  /// Throws invalid_argument_error naming the pointer otherwise.
  [[nodiscard]] std::pair<void*, std::size_t> get_base_allocation(void* ptr) const;
  /// The block holding `ptr` will not be reused until the work queued on
  /// `stream` before its free has completed (F11; PyTorch: recordStream).
  /// `stream` may be a special handle, resolved on the calling thread as in
  /// malloc. `ptr` may point inside a live block (a view at an offset): the owning
  /// block is found (SPEC X4; PyTorch ignores such pointers). A pointer inside
  /// no live block of this allocator is ignored. Throws invalid_argument_error,
  /// naming the stream and changing nothing, when `stream` is not a live stream
  /// of the block's device (destroyed, never created, another device's; as far
  /// as the backend can tell: device_backend::is_stream), unless it is the
  /// block's own stream; and, naming the tag, when the block (through its
  /// start or a pointer inside it) belongs to a paused tag. Thread-safe.
  void record_stream(void* ptr, stream_t stream);
  /// A new stream of `device` (the backend's create_stream); the allocator
  /// forgets that a destroyed stream had its handle
  /// (device_caching_allocator::stream_created). Throws invalid_argument_error
  /// for a device out of range, backend_error from the backend.
  [[nodiscard]] stream_t create_stream(int device);
  /// Destroys `stream` of `device`, telling the allocator first
  /// (device_caching_allocator::stream_destroyed): the stream's queued work
  /// completes (synchronize), and blocks allocated or recorded on it stay
  /// valid and are freed as usual later, recording nothing on it. A malloc
  /// on it then throws invalid_argument_error. Once its memory has moved on
  /// (its blocks freed, its cached segments adopted by another stream or
  /// returned to the device: with reuse_across_streams:False, at once, and
  /// a segment of its live blocks at the last one's free), the allocator
  /// keeps nothing of it: no host
  /// memory and no slow-path time per destroyed stream (SPEC P10). Destroying a stream through
  /// the backend directly, under the allocator, is not supported: a later
  /// free of its blocks may fail (backend_error or invalid_argument_error,
  /// the block stays allocated). Throws invalid_argument_error for a device
  /// out of range or a handle the backend rejects (nothing changed then,
  /// beyond the wait), backend_error from the backend.
  void destroy_stream(int device, stream_t stream);

  /// Lets `device` access the memory of `peer` (F26; PyTorch:
  /// enablePeerAccess(dev, dev_to_access)): enables the backend's peer access
  /// from `device` to `peer` (cudaDeviceEnablePeerAccess; plain segments) and
  /// grants `device` access to every page of `peer`'s expandable segments,
  /// mapped now or later (cuMemSetAccess). Calling it again does nothing.
  /// Throws invalid_argument_error for an uninitialized or equal device and
  /// backend_error when the backend cannot give the access
  /// (device_backend::can_access_peer is false).
  void enable_peer_access(int device, int peer);
  /// The expandable segments of `device`: per stream and pool, the bytes
  /// mapped now and the reservation (F19; PyTorch: getExpandableSegmentSizes).
  /// Throws invalid_argument_error for a bad device.
  [[nodiscard]] std::vector<expandable_segment_info> expandable_segment_sizes(int device) const;

  // --- inter-process sharing (F25; PyTorch: shareIpcHandle / getIpcDevPtr) --
  //
  // The producer shares a live block; another process opens the handle and
  // gets a pointer to the same bytes on the same device. Plain segments go
  // through cudaIpcGetMemHandle / cudaIpcOpenMemHandle (backend
  // capabilities().ipc), expandable segments through file descriptors of
  // their pages (capabilities().ipc_vm; the simulated device supports only
  // these). Plain segments: the producer must keep the block live (not free
  // it) while any consumer has it open; nothing tells the producer about
  // consumers. Expandable blocks (SPEC C3; docs/design.md, "IPC of
  // expandable memory") carry a lease: the consumer holds a slot in it while
  // it has the range open, and the producer's free() of the block waits for
  // the slots to clear (the block stays allocated; its pages are neither
  // recycled, unmapped nor released by empty_cache) and frees it at the next
  // empty_cache or reclaim_ipc_exports once no live process holds it. A
  // consumer that dies without closing stops holding (its process is gone).

  /// Shares the live block that starts at `ptr` (a pointer malloc returned).
  /// An expandable block is exported once: every share of it, until it is
  /// really freed, returns the same handle bytes and duplicates of the same
  /// descriptors (one per page it touches, then the lease's). Throws
  /// invalid_argument_error for any other pointer, and backend_error
  /// when the backend cannot share the block's kind of segment (the message
  /// says which). The returned descriptors are the caller's. Thread-safe.
  [[nodiscard]] ipc_export share_ipc_handle(void* ptr);
  /// Opens a handle from share_ipc_handle of another process (or of this one,
  /// for expandable segments) and returns a pointer to the block's first byte
  /// in this process, on the handle's device (which must be initialized
  /// here). `fds` are the descriptors sent with the handle, in order; they
  /// stay the caller's (close them after the call). Opening a handle of a
  /// segment (and, for expandable segments, page range) that is open already
  /// returns the cached mapping: the same pointer for the same block (plain
  /// segments: for the same access_device), with one more reference. Throws invalid_argument_error for a malformed handle
  /// (the parser's message), a device not initialized here, or a wrong number
  /// of descriptors; backend_error when the backend refuses (bad descriptor,
  /// a freed segment where the backend notices). Nothing stays open after an
  /// exception. Thread-safe.
  ///
  /// `access_device` (-1: the handle's device; other negative values are
  /// out of range) is the device whose kernels will use the mapping; it
  /// must be initialized here and, when it is not the handle's device, able
  /// to access that device (else backend_error "cannot access device"). A
  /// plain segment is opened for that device (cudaIpcOpenMemHandle with it
  /// current and cudaIpcMemLazyEnablePeerAccess, as CUDA documents for a
  /// consumer on another GPU), one mapping per accessing device: the mapping
  /// belongs to the context of the device it was opened for, and peer access
  /// does not make it usable from another device (docs/design.md, "Notes
  /// behind some rules"), so each device gets its own pointer. An expandable mapping is one per process: it gets
  /// read/write access (cuMemSetAccess) for the handle's device, the peers
  /// granted there with enable_peer_access before the open, and every
  /// device it is opened for (now or later).
  /// The cache key is
  /// the producer's process id, device, segment and (expandable) page range
  /// and file offsets: close a handle before its producer frees the block,
  /// else a later handle of new memory at the same place (same key) would
  /// get the stale cached mapping (PyTorch's cache, keyed by the handle,
  /// has the same rule).
  [[nodiscard]] void* open_ipc_handle(std::string_view handle, std::span<const int> fds = {}, int access_device = -1);
  /// Drops one reference to an opened handle; `ptr` is a pointer that
  /// open_ipc_handle returned. The mapping closes (cudaIpcCloseMemHandle, or
  /// unmap + release of the imported pages) when the last reference goes.
  /// Throws invalid_argument_error for any other pointer, an address inside
  /// the mapping included (it drops no reference: one holder's stray close
  /// cannot unmap memory another still uses), and for a pointer closed as
  /// many times as it was opened. Thread-safe.
  void close_ipc_handle(void* ptr);
  /// Mappings opened by open_ipc_handle and not yet closed (for tests).
  [[nodiscard]] std::size_t ipc_open_mappings() const;
  /// share_ipc_handle as bytes alone, for transports that carry no file
  /// descriptors (a pickle, torch.multiprocessing's queues): the handle plus
  /// the numbers and inode numbers of this process's own descriptors of the
  /// export, which stay open until the block is really freed. The importer
  /// takes them with pidfd_getfd (open_ipc_handle_pidfd). Layout: "ccIPCpfd",
  /// u32 descriptor count n, n x {i32 descriptor, u64 inode}, then the
  /// handle (little-endian). Throws what share_ipc_handle throws. Thread-safe.
  [[nodiscard]] std::string share_ipc_handle_pidfd(void* ptr);
  /// Opens bytes from share_ipc_handle_pidfd of another process: takes the
  /// exporter's descriptors with pidfd_open + pidfd_getfd (Linux 5.6; needs
  /// ptrace permission over the exporter: the same user, and under Yama
  /// ptrace_scope 1 an exporter that is a descendant or that allowed it with
  /// prctl(PR_SET_PTRACER)), checks that they are still the export's (same
  /// inodes), then open_ipc_handle. Throws invalid_argument_error for
  /// malformed bytes; backend_error naming the call and errno's text when the
  /// exporter is gone, permission is refused, or the descriptors no longer
  /// are the export's ("the exporter has freed the block"); what
  /// open_ipc_handle throws. The taken descriptors are closed before it
  /// returns. Thread-safe.
  [[nodiscard]] void* open_ipc_handle_pidfd(std::string_view bytes, int access_device = -1);
  /// Frees the exported blocks whose owner freed them while importers held
  /// them and that no live process holds any more (their importers closed
  /// them or ended). Returns how many blocks it freed. empty_cache calls it
  /// first. Throws what free() throws. Thread-safe.
  std::size_t reclaim_ipc_exports();
  /// The exported expandable blocks of this allocator, by pointer (a block
  /// is listed from its first share_ipc_handle until it is really freed).
  /// Clears the lease slots of importers that have ended. Thread-safe.
  [[nodiscard]] std::vector<ipc_export_info> ipc_exports() const;

  // --- copies (F27, F28) -------------------------------------------------------

  /// Queues a copy of `size_bytes` from `src` (on `src_device`) to `dst` (on
  /// `dst_device`) on `stream` (F27; PyTorch: memcpyAsync). A plain device
  /// copy (cudaMemcpyAsync) where that is safe: p2p_enabled (the devices
  /// access each other), one device, or neither device has expandable
  /// memory (its own expandable segments or opened expandable IPC handles);
  /// else a peer copy (cudaMemcpyPeerAsync), which also works for memory
  /// mapped with cuMemMap without peer access. Size 0 does nothing. Throws
  /// invalid_argument_error for a device not initialized, backend_error.
  void memcpy_async(void* dst, int dst_device, const void* src, int src_device, std::size_t size_bytes,
                    stream_t stream, bool p2p_enabled);
  /// Copies `size_bytes` from `src` to `dst` (device memory, any device with
  /// unified addressing) and returns when done (F28; PyTorch: copy_data,
  /// cudaMemcpy DeviceToDevice on the current device). Size 0 does nothing.
  void copy_data(void* dst, const void* src, std::size_t size_bytes) const;

  /// Statistics of `device` (F12; PyTorch: getDeviceStats).
  [[nodiscard]] device_stats get_device_stats(int device) const;
  void reset_accumulated_stats(int device);
  void reset_peak_stats(int device);

  /// Registers a callback for out-of-memory errors on every device (F17).
  void attach_out_of_memory_observer(oom_observer observer);

  // ---- memory history and snapshots (F13-F16, F18; ccalloc/core/history.hpp) --

  /// Starts, changes or stops recording the history of every device, also of
  /// devices init() adds later (F14; PyTorch: recordHistory, and
  /// torch.cuda.memory._record_memory_history). options.max_entries is per
  /// device. Disabling drops what was recorded. options.recorder is called
  /// outside the locks on the thread of each malloc (record_context::state
  /// and up) and free (all); its contexts are kept with their entries and
  /// live blocks and turned into frames when a snapshot is written. Throws
  /// invalid_argument_error for max_entries == 0 (nothing changes then).
  void record_history(const history_options& options);
  /// Whether history is being recorded (PyTorch: isHistoryEnabled).
  [[nodiscard]] bool is_history_enabled() const;
  /// Records key/value pairs with the current time on the current device
  /// (F15; PyTorch: recordAnnotation), kept while history is recorded;
  /// nothing otherwise. They appear in snapshots as external_annotations.
  void record_annotation(std::vector<std::pair<std::string, std::string>> metadata);
  /// Trace entries recorded until the matching pop carry `context` as their
  /// compile_context (F16; PyTorch: pushCompileContext). Only while history
  /// is recorded, as in PyTorch. Every device.
  void push_compile_context(std::string context);
  /// Pops the last pushed compile context; nothing if none (PyTorch: popCompileContext).
  void pop_compile_context();
  /// Trace entries recorded from now on carry `metadata` as user_metadata
  /// (F16; PyTorch: setUserMetadata). Every device; "" by default.
  void set_user_metadata(const std::string& metadata);
  /// The current user metadata (PyTorch: getUserMetadata).
  [[nodiscard]] std::string get_user_metadata() const;
  /// Calls `tracker` with every trace entry of every device from now on,
  /// whether history is recorded or not (F18; PyTorch:
  /// attachAllocatorTraceTracker). See trace_tracker for when it runs and what
  /// its exceptions do. Throws invalid_argument_error for an empty tracker.
  void attach_allocator_trace_tracker(trace_tracker tracker);
  /// Calls `listener` at every change of what any device has mapped from now
  /// on (devices initialized later too): a map after it, an unmap before it,
  /// synchronously under that device's locks (SPEC C1; see
  /// ccalloc/core/mapping_events.hpp for the order, the reasons and what a
  /// listener must not do: call into the allocator). Nothing is announced
  /// for what was mapped before; segments() lists it. Throws
  /// invalid_argument_error for an empty listener. Thread-safe.
  void attach_mapping_listener(mapping_listener listener);
  /// As attach_mapping_listener(listener), and calls `listed` once per
  /// initialized device with that device's segments, under the same hold of
  /// its locks as the attach: the listener hears every change of the device
  /// after that list and none before it, so a table built from the list and
  /// the announcements misses nothing (mapped_runs() gives what is mapped of
  /// each segment). `listed` must not call into the allocator. Throws
  /// invalid_argument_error for an empty listener, and what `listed` throws.
  void attach_mapping_listener(mapping_listener listener,
                               const std::function<void(const std::vector<segment_info>&)>& listed);
  /// Segments with their blocks, each device's trace (when include_traces
  /// and history is recorded; PyTorch records a `snapshot` entry first),
  /// the annotations and the settings in force (F13; PyTorch: snapshot).
  /// Each device is walked under its own locks: with concurrent allocations
  /// the devices are not captured at one instant. Before init(): empty.
  /// to_json() writes it for python/ccalloc/snapshot.py. With
  /// record_entry false no `snapshot` entry is recorded (what
  /// ccalloc_snapshot_json uses so that a size query and the call that
  /// fills the buffer see the same history).
  [[nodiscard]] memory_snapshot snapshot(bool include_traces = true, bool record_entry = true) const;
  /// Records a `snapshot` history entry on every device whose history is
  /// recorded, as snapshot() does first. Thread-safe.
  void record_snapshot_entry() const;

  /// Replaces the configuration of every device with `text` applied on top of
  /// the current one (F30). Throws config_error; nothing changes then.
  /// Warnings about settings without effect go to stderr, each once: those
  /// that the settings before this call had already printed are not
  /// printed again.
  void set_config(std::string_view text);
  [[nodiscard]] allocator_config config() const;

  // --- private pools and CUDA graphs (F20-F24); semantics in
  // device_caching_allocator.hpp. Each throws invalid_argument_error for a
  // bad device, plus what the device function throws. -----------------------

  /// A fresh private-pool id, {n, 0} with n = 1, 2, ... (PyTorch's
  /// MemPool ids; graph pools may use {0, n}). Process-wide and shared with
  /// the C API's ccalloc_new_pool_id and Python's, so ids never repeat
  /// within a process. Thread-safe, never throws.
  [[nodiscard]] static mempool_id_t new_pool_id() noexcept;
  /// PyTorch: createOrIncrefPool.
  void create_or_incref_pool(int device, mempool_id_t id, segment_allocator custom = {});
  /// PyTorch: releasePool.
  void release_pool(int device, mempool_id_t id);
  /// PyTorch: getPoolUseCount (0 for an unknown pool).
  [[nodiscard]] int get_pool_use_count(int device, mempool_id_t id) const;
  /// PyTorch: beginAllocateToPool. `filter` picks the streams (see
  /// stream_filter); it is called with resolved handles
  /// (device_backend::resolve_stream): to pick a per-thread default stream,
  /// compare with backend().resolve_stream(device, per_thread_stream_handle)
  /// taken on that thread.
  void begin_allocate_to_pool(int device, mempool_id_t id, stream_filter filter);
  /// PyTorch: endAllocateToPool.
  void end_allocate_to_pool(int device, mempool_id_t id);
  /// PyTorch: setUseOnOOM.
  void set_use_on_oom(int device, mempool_id_t id, bool enabled = true);
  /// PyTorch: setNoSplit.
  void set_no_split(int device, mempool_id_t id, bool enabled = true);
  /// PyTorch: checkPoolLiveAllocations.
  [[nodiscard]] bool check_pool_live_allocations(int device, mempool_id_t id,
                                                 const std::vector<void*>& expected) const;
  /// Per-pool bytes ({0, 0}: the default pool).
  [[nodiscard]] pool_usage get_pool_stats(int device, mempool_id_t id) const;
  /// PyTorch: getCheckpointState.
  [[nodiscard]] pool_checkpoint get_checkpoint_state(int device, mempool_id_t id) const;
  /// PyTorch: setCheckpointPoolState. Also updates this allocator's pointer
  /// table: freed_pointers are no longer live here (free() of one throws),
  /// the created blocks' pointers are (free each once with free()).
  checkpoint_restore_result set_checkpoint_pool_state(int device, const pool_checkpoint& state);

  // --- sleep and wake (SPEC S1-S5; core/tags.hpp for tags and scopes) -----

  /// device_caching_allocator::pause on `device`, or on every device when
  /// device is -1 (the figures summed, each tag named once). Throws as that
  /// does (devices before the failing one stay paused), and
  /// invalid_argument_error before init() or for a bad device.
  sleep_result pause(const std::vector<std::string>& tags, bool keep_contents, int device = -1);
  /// device_caching_allocator::resume on `device`, or every device (-1).
  sleep_result resume(const std::vector<std::string>& tags, int device = -1);
  /// device_caching_allocator::tag_stats of `device`.
  [[nodiscard]] std::vector<tag_usage> tag_stats(int device) const;
  /// The tags paused on `device`.
  [[nodiscard]] std::vector<std::string> paused_tags(int device) const;

  /// The device allocator of `device` (for snapshots and tests). Throws
  /// invalid_argument_error for a bad device.
  [[nodiscard]] device_caching_allocator& device_allocator(int device) const;

 private:
  struct pointer_entry {
    int device = 0;
    detail::block* block = nullptr;
  };
  struct alignas(64) pointer_shard {  // one cache line each: no false sharing of the locks
    detail::yield_lock mutex;  // held for a lookup, insert or erase only
    detail::pointer_map<pointer_entry> blocks;
  };
  static constexpr std::size_t pointer_shard_count = 256;  // a power of two
  pointer_shard& shard_for(void* ptr) const noexcept;
  /// Throws invalid_argument_error: free of `ptr`, which is not live here.
  [[noreturn, gnu::cold]] static void throw_not_live(void* ptr);
  static void print_warnings(const allocator_config& config);
  static history_options disabled_history() {
    history_options o;
    o.enabled = false;
    return o;
  }
  /// The allocator of `device`; throws invalid_argument_error naming `what`
  /// before init() or for a device out of range.
  device_caching_allocator& checked_device(int device, const char* what) const;
  /// The entry of a pointer this allocator handed out, or nullopt.
  std::optional<pointer_entry> find_entry(void* ptr) const;
  /// free() of `ptr` (just removed from the pointer map) when blocks are
  /// exported: true when `ptr` is an exported block that importers hold
  /// (the free is deferred); false when the caller is to free it now.
  [[gnu::cold]] bool defer_exported_free(void* ptr);

  // config_mutex_, unless this thread holds it already (a mapping listener
  // that enable() or set_config() announce to, calling config() or
  // attach_mapping_listener: they then run under that hold).
  [[nodiscard]] std::unique_lock<std::mutex> lock_config() const;

  std::shared_ptr<device_backend> backend_;
  mutable std::mutex config_mutex_;
  allocator_config config_;
  std::atomic<bool> caching_enabled_{true};
  std::vector<std::unique_ptr<device_caching_allocator>> devices_;
  std::vector<oom_observer> observers_;
  history_options history_options_ = disabled_history();  // applied to devices init() adds
  std::vector<mapping_listener> mapping_listeners_;     // [config_mutex_]
  std::vector<trace_tracker> trackers_;                 // likewise
  std::string user_metadata_;                           // likewise
  mutable std::array<pointer_shard, pointer_shard_count> shards_;
  std::unique_ptr<detail::ipc_cache> ipc_;  // opened IPC handles (src/frontend/ipc.cpp)
  std::atomic<std::size_t> ipc_export_count_{0};  // exports_->entries.size(), for free()'s test
  // Exported expandable blocks (src/frontend/ipc_export.cpp); destroyed
  // before the devices whose blocks it names.
  std::unique_ptr<detail::ipc_exports> exports_;
  // Around a fork (base/detail/fork_handlers.hpp): config_mutex_, the IPC
  // exports' and imports' locks (rank front_end), then the pointer map's
  // shards (rank leaf). Registered at the end of the constructor; declared
  // last: cancelled before any member above is destroyed.
  std::optional<detail::fork_registration> fork_front_;
  std::optional<detail::fork_registration> fork_shards_;
};


/// RAII scope of begin/end_allocate_to_pool (PyTorch's
/// `with torch.cuda.use_mem_pool(pool)`): while it lives, allocations on
/// the chosen streams of `device` come from the private pool `id`; its end
/// calls end_allocate_to_pool. The pool must exist (create_or_incref_pool).
/// Not copyable or movable. The constructor throws what
/// begin_allocate_to_pool throws (invalid_argument_error for a bad device);
/// the destructor never throws. Use it on one thread; the allocator it
/// refers to must outlive it.
class pool_scope {
 public:
  /// Routes allocations on `stream` (a handle as malloc takes it) to the pool.
  pool_scope(caching_allocator& allocator, int device, mempool_id_t id, stream_t stream)
      : pool_scope(allocator, device, id, stream_filter([stream](stream_t s) { return s == stream; })) {}
  /// Routes allocations on the streams `filter` accepts (resolved handles,
  /// see begin_allocate_to_pool) to the pool.
  pool_scope(caching_allocator& allocator, int device, mempool_id_t id, stream_filter filter)
      : allocator_(allocator), device_(device), id_(id) {
    allocator_.begin_allocate_to_pool(device_, id_, std::move(filter));
  }
  pool_scope(const pool_scope&) = delete;
  pool_scope& operator=(const pool_scope&) = delete;
  ~pool_scope() {
    try {
      allocator_.end_allocate_to_pool(device_, id_);
    } catch (...) {  // only for a pool that begin_allocate_to_pool accepted: not expected
    }
  }

 private:
  caching_allocator& allocator_;
  int device_;
  mempool_id_t id_;
};

// ---- the hot path's entry points, inline ----------------------------------------------
// Always inlined (a few dozen instructions at each call site): the caller
// calls the device allocator's malloc or free directly.

inline caching_allocator::pointer_shard& caching_allocator::shard_for(void* ptr) const noexcept {
  // Blocks are 512-byte aligned: drop those bits, then take the top bits of a
  // multiplicative hash whose multiplier differs from the one the map inside
  // the shard uses, so a shard's keys still spread over its map's slots.
  const auto a = reinterpret_cast<std::uintptr_t>(ptr) >> 9;
  static_assert(pointer_shard_count == 256, "the shift below takes 8 bits");
  return shards_[(a * 0xD6E8FEB86659FD93ull) >> 56];
}

[[gnu::always_inline]] inline void* caching_allocator::malloc(int device, std::size_t size_bytes, stream_t stream) {
  // An initialized device: one comparison (a negative one wraps around);
  // checked_device gives the error otherwise.
  const auto index = static_cast<std::size_t>(device);
  device_caching_allocator& dev = index < devices_.size() ? *devices_[index] : checked_device(device, "malloc");
  if (size_bytes == 0) return nullptr;
  // The pools are keyed by the stream itself: cudaStreamPerThread's value
  // means a different stream on each thread (NVIDIA/cub#373). resolve_stream
  // returns every other handle unchanged (its contract in device_backend.hpp)
  // and the device is valid: only the two special handles need the call.
  const bool special = stream == legacy_stream_handle || stream == per_thread_stream_handle;
  allocation a = dev.malloc(size_bytes, special ? backend_->resolve_stream(device, stream) : stream);
  auto& shard = shard_for(a.ptr);
  {
    std::lock_guard lock(shard.mutex);
    shard.blocks.insert(reinterpret_cast<std::uintptr_t>(a.ptr), pointer_entry{device, a.block});
  }
  return a.ptr;
}

[[gnu::always_inline]] inline void caching_allocator::free(void* ptr) {
  if (ptr == nullptr) return;
  auto& shard = shard_for(ptr);
  const auto key = reinterpret_cast<std::uintptr_t>(ptr);
  pointer_entry entry;
  bool found = false;
  {
    std::lock_guard lock(shard.mutex);
    found = shard.blocks.erase(key, &entry);
  }
  if (!found) [[unlikely]]
    throw_not_live(ptr);
  if (ipc_export_count_.load(std::memory_order_relaxed) != 0) [[unlikely]] {
    bool deferred = false;
    try {
      deferred = defer_exported_free(ptr);
    } catch (...) {
      std::lock_guard lock(shard.mutex);
      shard.blocks.insert(key, entry);
      throw;
    }
    if (deferred) return;
  }
  try {
    devices_[static_cast<std::size_t>(entry.device)]->free(entry.block);
  } catch (...) {
    std::lock_guard lock(shard.mutex);  // the free did not happen: keep the pointer live
    shard.blocks.insert(key, entry);
    throw;
  }
}

/// The process-wide allocator used by raw_deleter() and the C API. Created on
/// first use with the default backend (CUDA when built with it and a GPU is
/// present, else the simulated device). Never destroyed.
[[nodiscard]] caching_allocator& global_allocator();

}  // namespace ccalloc
