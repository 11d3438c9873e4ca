// ccalloc/backend/sim_backend.hpp: a simulated device in host memory.
//
// What it is: a device_backend whose "device memory" is host address space
// (anonymous mappings made with MAP_NORESERVE, so untouched pages cost no RAM,
// at addresses of its own: "Addresses" below),
// with a capacity per device, CUDA's 2 MiB allocation granularity, and streams
// and events driven by a virtual clock that the caller advances. It is the
// embedded default for `ccalloc replay` and what every CI test runs on. All
// sizes are in bytes.
//
// Time model: the clock is an unsigned counter of virtual time units (the
// replay uses one unit per trace event; tests pick their own). Each stream has
// a "busy until" time: enqueue_work(stream, until) says that work queued on the
// stream runs until `until`. An event recorded on a stream completes when the
// clock reaches the stream's busy-until time at the moment of recording.
// synchronize_* advance the clock to when the awaited work completes (the host
// waited that long). stream_wait_event makes a stream's busy-until time at
// least the event's completion time (a device-side wait; the clock does not
// move). segment_free waits for the device as cudaFree does: the
// clock advances to the latest busy-until time of the device's streams, so
// every event recorded before it has completed afterwards (and a stream
// behind a closed gate makes it throw, see Gates); the replay turns this off
// (sim_options::segment_free_synchronizes).
//
// Streams: the default stream (0, also legacy_stream_handle), the per-thread
// default streams (per_thread_stream_handle is the calling thread's own,
// resolve_stream's handle for that thread, so two threads passing it use two
// streams, as on CUDA), and the streams create_stream or adopt_stream made on
// a device and destroy_stream has not destroyed. Every call that takes a
// stream throws invalid_argument_error naming the handle for any other
// handle (never created, destroyed, or another device's), as CUDA fails
// such a call; adopt_stream gives a stream a chosen handle (the replay uses
// a trace's stream ids as they are).
//
// What differs from a GPU (a test passing here may not prove the GPU case):
// - Nothing runs: kernels are enqueue_work calls, copies are a memmove at
//   once (the clock does not see them), and memory can be read and written
//   from the host at any time, also while "in use" on a stream.
// - Time passes only when the caller moves the clock or the host waits
//   (synchronize_*, segment_free); a query never sees work finish by itself.
// - vm_unmap, vm_release_handle and vm_release wait for nothing (cuMemUnmap
//   does not either; the allocator synchronizes before unmapping on both).
// - Another thread's per-thread default stream is fully usable from any
//   thread (record_event, synchronize_stream, wait_gate); on CUDA only its
//   own thread can name it, and cuda_backend falls back to the legacy default
//   stream or the whole device there (cuda_backend.hpp).
// - Every stream is non-blocking: work on stream 0 does not wait for other
//   streams (CUDA's legacy default stream does, for blocking streams).
// - Capture: only begin_capture / end_capture exist; nothing is recorded.
// - Out of memory is a capacity count; there is no fragmentation of the
//   physical memory, no context overhead, no driver reserve.
// - IPC: opening a segment exported by this process is refused as on CUDA;
//   exported pages stay alive for importers by never being reused (below).
//
// Gates (capabilities().gates): a gate is an id. wait_gate on a closed gate
// makes the stream's work wait until the gate opens: its busy-until time is
// "never" (busy_until returns UINT64_MAX) and events recorded on it
// meanwhile do not complete. open_gate releases the waiting streams at the
// current time (busy-until becomes max(busy-until, now)) and lets those
// events complete at max(their time, now). The simulated device cannot block,
// so a wait that a real device would never finish (synchronize_event on such
// an event, synchronize_stream on a waiting stream, synchronize_device while
// one of its streams waits) throws backend_error naming the gate instead of
// deadlocking. destroy_gate of a closed gate throws backend_error.
//
// Virtual memory (capabilities().virtual_memory; expandable segments, SPEC
// B7): real address-space reservations and real page mappings, following
// CUDA's driver API (cuMemAddressReserve, cuMemCreate, cuMemMap,
// cuMemSetAccess, cuMemUnmap, cuMemRelease, cuMemAddressFree):
// - vm_reserve is an mmap(PROT_NONE, MAP_NORESERVE) aligned to the
//   granularity: it costs address space, no capacity and no RAM.
// - Physical memory is a range of one sparse anonymous memory file per device
//   (memfd_create); vm_create charges the device's capacity exactly like
//   segment_malloc (one `used_bytes` for both, so mem_get_info's free bytes
//   reflect segments and handles), and vm_release_handle punches the range
//   out of the file, so its RAM goes back at once.
// - vm_map maps the handle's range of the file MAP_SHARED|MAP_FIXED over the
//   reservation: every byte written through the mapping is in the handle, so
//   a handle unmapped and mapped again elsewhere keeps its contents, and a
//   handle mapped at two addresses at once (CUDA allows it) shows the same
//   bytes at both. vm_unmap puts the PROT_NONE reservation back in one
//   MAP_FIXED mmap (the range is never free for another mmap meanwhile).
// - New handles read as zeros (CUDA does not promise that; do not rely on it).
// The rules the simulated device checks (each violation throws backend_error
// and leaves the state unchanged), stricter than CUDA where CUDA's behaviour
// would hide an allocator bug:
// - every address and size is a multiple of vm_granularity(device), sizes > 0;
// - vm_map maps one whole handle (offset 0, size_bytes == the handle's size;
//   CUDA could map a subrange with an offset), of the same device, inside one
//   live reservation of that device, over no existing mapping;
// - vm_unmap and vm_set_access take a range that is exactly a union of whole,
//   adjacent mappings of `device` without gaps: one mapping or several
//   (cuMemUnmap cannot unmap part of a mapping; cuMemSetAccess wants a fully
//   mapped range);
// - vm_release_handle of a handle that is still mapped throws (CUDA would
//   defer the release until the last unmap);
// - vm_release takes a whole reservation (its base and size) with no mapping
//   left inside.
// Linux limits a process to vm.max_map_count mappings (65530 by default):
// each mapped range is one, and so is each unmapped stretch of a reservation
// between mappings (the kernel merges neighbours only when their file ranges
// are adjacent too), so a reservation with n separate mapped ranges uses up
// to 2n + 1. A failed mmap in vm_map or vm_unmap throws backend_error with
// errno's text (for ENOMEM also naming the limit that applies: the
// address-space limit RLIMIT_AS when what the process maps passes it, else
// vm.max_map_count; docs/errors.md); a reservation mmap
// failing with ENOMEM makes vm_reserve return nullptr, as cuMemAddressReserve
// reports out of memory.
// The virtual-memory functions need granularity_bytes to be a multiple of the
// host page size (4 KiB); with a smaller granularity capabilities() reports
// virtual_memory = false and they throw "not supported".
//
// Peers (capabilities().peer_access when sim_options::peer_access): any two
// distinct devices can access each other; one address space serves all
// devices, so enable_peer_access and vm_set_access only record the grant
// (peer_access_enabled and peer_can_access read it back).
//
// Addresses (segment_malloc): each device has its own address range, one
// host range reserved inaccessible (PROT_NONE, MAP_NORESERVE: no RAM) on the
// device's first segment_malloc, twice its capacity, aligned to the
// granularity. A segment is mapped into it (MAP_FIXED) at the lowest free
// address that holds it, as a driver's first-fit virtual-address allocator
// hands out increasing addresses while nothing is freed; segment_free makes
// its stretch inaccessible and free again (coalesced with its neighbours).
// So a segment's offset from the range's base depends only on the sequence
// of segment_malloc and segment_free calls of that device: not on where the
// host's mmap puts things, address-space randomization, other threads'
// malloc arenas or the host's other mappings; the allocator's best fit,
// which breaks ties between equal free blocks by address, chooses the same
// way in every run. place_segments can give the next calls chosen offsets
// (a recording's placement, see there). Only when the range is full (the
// capacity raised past it with set_capacity, or address fragmentation) or
// the host could not reserve it (a capacity beyond the address space, an
// RLIMIT_AS) is a segment a host mapping wherever mmap puts it. Virtual
// memory reservations (vm_reserve) are host mappings, placed top down in
// the backend's own order: below the lowest reservation it placed (a guard
// apart, stepping over other mappings of the process), or in the slot a
// released one left, taken with MAP_FIXED_NOREPLACE (wherever mmap puts it
// only when every such place is taken). Which of two reservations is lower,
// the best fit's tie-break between equal free blocks of two reservations,
// then depends only on this backend's calls, not on other threads.
//
// Capacity: every segment_malloc of n bytes uses n rounded up to the
// granularity; it returns nullptr when that would pass the capacity, and
// throws backend_error ("the host could not reserve the simulated memory:
// mmap failed: <errno text>") when the capacity allows it but the host
// cannot map it (e.g. more than the process's address space). vm_create
// uses its size (a multiple of the granularity) and returns false instead.
// Invariant, per device: used_bytes = sum of live segments' charged bytes +
// sum of live handles' sizes <= capacity (unless set_capacity lowered it).
//
// Fault injection: fail_segment_malloc_after(n) makes the n-th segment_malloc
// from now (1 = the next one) return nullptr as if out of memory;
// fail_event_query_after(n) makes the n-th query_event throw backend_error;
// fail_vm_create_after(n) makes the n-th vm_create return false as if out of
// memory; fail_vm_map_after(n) makes the n-th vm_map throw backend_error
// (nothing mapped); fail_vm_unmap_after(n) makes the n-th vm_unmap throw
// backend_error (nothing unmapped), and fail_vm_unmap_after(n, count) that
// one and the count - 1 vm_unmap calls after it (a refusal and its retries);
// fail_stream_wait_after(n) makes the n-th
// stream_wait_event throw backend_error (the stream does not wait). Calls
// rejected for bad arguments do not count.
//
// Thread safety: all functions may be called concurrently (one internal mutex,
// also held across the mmap calls; the simulated device is not a hot path).
// Fork: the child of a fork() gets the device as it was (the fork handlers
// hold the mutex across the fork) with memory of its own: plain segments are
// private host mappings (copied on write); physical memory of vm_create and
// exported segments live in shared memory files, which the parent copies
// before the fork (their data: time and host memory in proportion) and the
// child maps in their place. Memory imported from other processes (IPC)
// stays shared. If the host refuses a copy, the child warns on stderr and
// that memory stays shared with the parent.
// Cost: reservations and mappings live in ordered maps (O(log n) lookups);
// vm_create's search of freed file ranges is first fit, O(freed ranges).
#pragma once

#include <ccalloc/backend/device_backend.hpp>
#include <ccalloc/backend/host_clock.hpp>

#include <cstdint>
#include <optional>
#include <memory>
#include <vector>

namespace ccalloc {

struct sim_options {
  int device_count = 1;
  /// Capacity of each device in bytes. Default: 141 GB, an H200's.
  std::size_t capacity_bytes = std::size_t{141} * 1000 * 1000 * 1000;
  /// Allocation granularity (bytes, a power of two): segment sizes are
  /// charged rounded up to it.
  std::size_t granularity_bytes = 2 * mib;
  /// Whether distinct devices can access each other (can_access_peer,
  /// enable_peer_access, vm_set_access for another device). Default: true.
  bool peer_access = true;
  /// Whether segment_free waits for the device as cudaFree does (the clock
  /// advances to the latest busy-until time of the device's streams).
  /// Default: true. The replay turns it off: its side streams' work stands
  /// for the lag between a free and PyTorch seeing the block's event
  /// complete (the recorded free_completed), not for work a cudaFree would
  /// wait for; on a GPU the replay defers segment frees past that lag
  /// instead (replay.hpp).
  bool segment_free_synchronizes = true;
  /// The host clock the allocator's time budgets read (host_time_us; see
  /// allocator_config::recycle_time_percent):
  ///   none     no clock (the default): the budgets do not apply, so tests
  ///            see the allocator's memory policies unlimited (but
  ///            recycle_time_percent:0, which needs no clock, still means never);
  ///   modeled  the time set_host_time_us set (the replay: the recording's
  ///            time) plus the cost an H200 takes for the virtual-memory
  ///            calls made (host_clock.hpp);
  ///   steady   the steady clock plus that cost (benchmarks: the time a
  ///            program on a GPU would see).
  enum class host_clock { none, modeled, steady };
  host_clock host_clock_mode = host_clock::none;
};

/// One entry of sim_backend::place_segments: an offset from the device's
/// address range's base and a segment size, both bytes and multiples of the
/// granularity.
struct segment_placement {
  std::size_t offset_bytes = 0;
  std::size_t size_bytes = 0;
};

/// Counters the simulated device keeps (for tests and the replay report).
struct sim_counters {
  std::uint64_t segment_mallocs = 0;  ///< successful segment_malloc calls
  std::uint64_t segment_frees = 0;
  std::uint64_t failed_mallocs = 0;   ///< segment_malloc calls that returned nullptr
  /// Charged bytes of live segments plus bytes of live physical handles, all
  /// devices (the capacity both draw on).
  std::size_t used_bytes = 0;
  std::uint64_t live_events = 0;      ///< created and not destroyed
  std::uint64_t event_queries = 0;    ///< query_event calls (the allocator's polling cost)
  std::uint64_t live_streams = 0;
  std::uint64_t live_gates = 0;       ///< created and not destroyed
  // Virtual memory, all devices. Invariants: live_handles = vm_creates -
  // vm_release_handles; mapped_bytes = sum of the sizes of live mappings.
  std::uint64_t vm_creates = 0;          ///< successful vm_create calls
  std::uint64_t failed_vm_creates = 0;   ///< vm_create calls that returned false
  std::uint64_t vm_release_handles = 0;  ///< successful vm_release_handle calls
  std::uint64_t vm_maps = 0;             ///< successful vm_map calls (one mapping each)
  std::uint64_t vm_unmaps = 0;           ///< mappings removed by vm_unmap (one call may remove several)
  std::uint64_t live_handles = 0;        ///< created and not released
  std::size_t handle_bytes = 0;          ///< bytes of live handles (part of used_bytes)
  std::size_t mapped_bytes = 0;          ///< bytes of live mappings
  std::uint64_t live_reservations = 0;   ///< reserved and not released
  std::size_t reserved_address_bytes = 0;  ///< bytes of live reservations
  // Inter-process sharing and copies.
  std::uint64_t vm_exports = 0;   ///< successful vm_export_handle calls
  std::uint64_t vm_imports = 0;   ///< successful vm_import_handle calls (imported handles count in live_handles)
  std::uint64_t memcpy_async_calls = 0;
  std::uint64_t memcpy_peer_async_calls = 0;
  std::uint64_t copy_data_calls = 0;
  /// Pages unmapped (vm_unmap) while work declared with use_memory on them
  /// could still run (the clock before that work's end): a use-after-unmap
  /// on a real device. Tests expect 0.
  std::uint64_t unsafe_unmaps = 0;
  /// Mapped pages declared with use_memory by the work of one stream while
  /// the work of another stream used the same physical page (through any
  /// address) over an overlapping time: each use runs from where the work
  /// enqueue_work queued last on its stream starts (that stream's busy-until
  /// before it; a stream_wait_event pushes it past the event) until it
  /// ends. A use-after-reuse on a real device. Tests expect 0.
  std::uint64_t unsafe_reuses = 0;
  std::uint64_t stream_waits = 0;  ///< successful stream_wait_event calls
  /// Device accesses (use_memory, copy_to_host_async, copy_from_host_async)
  /// to a page of a reservation that nothing is mapped at (a paused tag's
  /// page, say): a fault on a real device. Tests expect 0.
  std::uint64_t unmapped_uses = 0;
  std::uint64_t host_allocs = 0;          ///< successful host_alloc calls
  std::size_t host_bytes = 0;             ///< bytes of live host_alloc memory
  std::size_t bytes_to_host = 0;          ///< copy_to_host_async bytes
  std::size_t bytes_from_host = 0;        ///< copy_from_host_async bytes
};

class sim_backend final : public device_backend {
 public:
  explicit sim_backend(sim_options options = {});
  ~sim_backend() override;
  sim_backend(const sim_backend&) = delete;
  sim_backend& operator=(const sim_backend&) = delete;

  [[nodiscard]] std::string name() const override { return "sim"; }
  /// gates and stream_wait: true; virtual_memory: true when granularity_bytes is a multiple
  /// of the host page size; peer_access: sim_options::peer_access (also with
  /// one device: the functions work, can_access_peer just says false); ipc:
  /// true; ipc_vm: as virtual_memory.
  [[nodiscard]] backend_capabilities capabilities() const override;
  [[nodiscard]] int device_count() const override;
  [[nodiscard]] int current_device() const override;
  void set_device(int device) override;
  [[nodiscard]] memory_info mem_get_info(int device) const override;

  [[nodiscard]] void* segment_malloc(int device, std::size_t size_bytes) override;
  void segment_free(int device, void* ptr) override;
  /// Gives the next successful segment_malloc calls of `device` their
  /// addresses (see "Addresses"): the k-th from now goes at base +
  /// plan[k].offset_bytes when its charged size equals plan[k].size_bytes
  /// and that stretch is free; otherwise (and after the plan) at the lowest
  /// free address. The replay passes a recording's segment addresses
  /// (relative order and gaps), so that ties break as they did on the GPU.
  /// Replaces an earlier plan. Throws invalid_argument_error, naming the
  /// entry, for an offset or size off the granularity or a size of 0 (the
  /// plan is then unchanged). Thread-safe.
  void place_segments(int device, std::vector<segment_placement> plan);

  /// A new stream of `device`; its handle is never 0, 1, 2, a per-thread
  /// handle, or a handle adopt_stream gave to a live stream.
  [[nodiscard]] stream_t create_stream(int device) override;
  /// Makes `stream` a live stream of `device` under that very handle, as if
  /// create_stream had returned it (destroy_stream ends it), so that a
  /// trace's stream ids can be used directly. Throws invalid_argument_error
  /// for 0, 1, 2 or a per-thread handle, and for a handle that is a live
  /// stream of any device already; backend_error for a device out of range.
  /// Thread-safe.
  void adopt_stream(int device, stream_t stream);
  /// Throws invalid_argument_error for a handle that is not a live stream
  /// create_stream or adopt_stream made on `device`.
  void destroy_stream(int device, stream_t stream) override;
  /// The default stream, the calling thread's per-thread default stream
  /// (resolve_stream of per_thread_stream_handle on this thread; another
  /// thread's, or any other handle with the per-thread bit, is not: no
  /// thread can name it, as in CUDA), or a live stream create_stream or
  /// adopt_stream made on `device`. Thread-safe.
  [[nodiscard]] bool is_stream(int device, stream_t stream) override;
  [[nodiscard]] event_t create_event(int device) override;
  void destroy_event(int device, event_t event) override;
  void record_event(int device, event_t event, stream_t stream) override;
  [[nodiscard]] bool query_event(int device, event_t event) override;
  void synchronize_event(int device, event_t event) override;
  /// The stream's later work starts no earlier than the event completes:
  /// its busy-until time becomes max(its own, the event's completion time
  /// as recorded now); behind closed gates the event waits on, the stream
  /// waits on them too (busy_until says UINT64_MAX until they open). The
  /// clock does not move. Throws invalid_argument_error for a handle that is
  /// not a stream of `device`, backend_error for an unknown event or one of
  /// another device, and backend_error while a stream of `device` captures
  /// (stricter than CUDA, which would make it a graph dependency: the
  /// allocator must not add one). Counted in sim_counters::stream_waits.
  void stream_wait_event(int device, stream_t stream, event_t event) override;
  void synchronize_stream(int device, stream_t stream) override;
  void synchronize_device(int device) override;
  /// True between begin_capture and end_capture of `stream`.
  [[nodiscard]] bool is_capturing(int device, stream_t stream) override;

  // --- graph capture (sim controls) ---------------------------------------------
  //
  // While a stream of a device captures, query_event, synchronize_event,
  // synchronize_device and segment_free on that device throw backend_error
  // naming the capturing stream, as CUDA's global capture mode fails them
  // with cudaErrorStreamCaptureUnsupported. No work is recorded meanwhile
  // (the sim runs nothing); enqueue_work still advances stream times.

  /// Starts capturing on `stream` (cudaStreamBeginCapture). Throws
  /// backend_error if it captures already.
  void begin_capture(int device, stream_t stream);
  /// Ends the capture on `stream` (cudaStreamEndCapture). Throws
  /// backend_error if it does not capture.
  void end_capture(int device, stream_t stream);

  // --- virtual memory (see the header comment for the rules checked) ----------
  //
  // Each throws backend_error("sim: <function>(device D, <address>, N bytes):
  // <what is wrong>") on misuse, with the state unchanged, and
  // backend_error("<function> is not supported by the 'sim' backend") when
  // capabilities().virtual_memory is false. Addresses and sizes in bytes.

  /// sim_options::granularity_bytes.
  [[nodiscard]] std::size_t vm_granularity(int device) const override;
  /// Reserves `size_bytes` (> 0, a multiple of the granularity) of address
  /// space aligned to the granularity; no capacity is charged. Returns
  /// nullptr when the host address space is exhausted (mmap ENOMEM).
  [[nodiscard]] void* vm_reserve(int device, std::size_t size_bytes) override;
  /// Releases a whole reservation: `base` and `size_bytes` exactly as
  /// vm_reserve gave them, on the same device, with no mapping inside.
  void vm_release(int device, void* base, std::size_t size_bytes) override;
  /// Creates a handle of `size_bytes` (> 0, a multiple of the granularity) of
  /// `device`'s capacity; writes a nonzero id to *handle (non-null). Returns
  /// false (and leaves *handle) when the capacity would be passed or an
  /// injected fault fires. Ids are not reused.
  [[nodiscard]] bool vm_create(int device, std::size_t size_bytes, physical_handle_t* handle) override;
  /// Releases an unmapped handle of `device`; its capacity and RAM go back.
  void vm_release_handle(int device, physical_handle_t handle) override;
  /// Maps the whole handle (`size_bytes` == its size) of `device` at `addr`
  /// (granularity-aligned, inside one reservation of `device`, over no
  /// mapping) read/write for `device`.
  void vm_map(int device, void* addr, std::size_t size_bytes, physical_handle_t handle) override;
  /// Unmaps [addr, addr + size_bytes), a union of whole adjacent mappings of
  /// `device`; the range stays reserved. The handles keep their contents.
  void vm_unmap(int device, void* addr, std::size_t size_bytes) override;
  /// Records that `peer` may access [addr, addr + size_bytes) (a union of
  /// whole adjacent mappings of `device`). Granting it again, or to `device`
  /// itself, does nothing. Throws when peer access is off and peer != device.
  /// The grant ends with the mapping (a new mapping grants `device` only).
  void vm_set_access(int device, void* addr, std::size_t size_bytes, int peer) override;

  // --- inter-process sharing ---------------------------------------------------
  //
  // Plain segments: ipc_export_segment moves the segment into a memory file
  // in place (same address, same bytes; it then costs RAM for all its bytes)
  // and returns a handle naming this process and the file's descriptor;
  // ipc_open_segment in another process opens /proc/<pid>/fd/<fd> (the
  // producer must still run and hold the segment; same user) and maps it.
  // Like CUDA, a process cannot open its own export. Freeing the segment
  // closes the producer's descriptor; openers keep their mapping.
  //
  // Expandable pages: a handle is a range of the device's memory file, so an export is a
  // duplicate of that file's descriptor plus the range's offset; another
  // process (fork, or one that received the fd over a Unix socket) imports
  // it and maps it MAP_SHARED: both see the same bytes. As on CUDA, the
  // importer's mapping stays valid after the exporter releases the handle
  // or exits: vm_release_handle of a handle ever exported gives the
  // capacity back but leaves its range of the file as it is, never handed
  // out again (the file's pages go when every process has closed the file;
  // CUDA frees them when the last importer releases its handle). Imported
  // handles draw on no capacity. vm_release_handle of an imported handle
  // closes its descriptor.

  [[nodiscard]] ipc_mem_handle ipc_export_segment(int device, void* base) override;
  [[nodiscard]] void* ipc_open_segment(int device, const ipc_mem_handle& handle) override;
  void ipc_close_segment(int device, void* ptr) override;

  /// A new descriptor (close-on-exec; the caller owns it) of `device`'s
  /// memory file and the handle's range in it.
  [[nodiscard]] shareable_handle vm_export_handle(int device, physical_handle_t handle) override;
  /// A handle of `device` for the range [offset, offset + size) of the file
  /// behind `shared.fd` (duplicated; the caller keeps its fd). Throws
  /// backend_error for a descriptor that is not an open regular file, a
  /// range past the file's end, or sizes/offsets off the granularity.
  [[nodiscard]] physical_handle_t vm_import_handle(int device, const shareable_handle& shared) override;

  // --- copies: memmove at once (the virtual clock does not model copies) -----

  void memcpy_async(int device, void* dst, const void* src, std::size_t size_bytes, stream_t stream) override;
  void memcpy_peer_async(void* dst, int dst_device, const void* src, int src_device, std::size_t size_bytes,
                         stream_t stream) override;
  void copy_data(int device, void* dst, const void* src, std::size_t size_bytes) override;
  /// Host memory from std::malloc (counted in sim_counters::host_bytes);
  /// copies are memmoves that also charge the modelled host clock at
  /// host_copy_bytes_per_us (a pinned PCIe 5 x16 copy on an H200's host)
  /// and count an access to an unmapped page of a reservation in
  /// sim_counters::unmapped_uses. Each copy is also declared as a use of its
  /// device range by the work queued on `stream` (use_memory): unmapping a
  /// page of it before that work ends counts as unsafe.
  [[nodiscard]] void* host_alloc(int device, std::size_t size_bytes) override;
  void host_free(int device, void* ptr) noexcept override;
  void copy_to_host_async(int device, void* host_dst, const void* device_src, std::size_t size_bytes,
                          stream_t stream) override;
  void copy_from_host_async(int device, void* device_dst, const void* host_src, std::size_t size_bytes,
                            stream_t stream) override;

  // --- peers --------------------------------------------------------------------

  /// True for two distinct valid devices when sim_options::peer_access; false
  /// when device == peer (as cudaDeviceCanAccessPeer). Throws backend_error
  /// for an index out of range.
  [[nodiscard]] bool can_access_peer(int device, int peer) const override;
  /// Records that `device` may access `peer`'s segments. Enabling it again is
  /// not an error (cuda_backend also clears cudaErrorPeerAccessAlreadyEnabled).
  /// Throws backend_error for device == peer, an index out of range, or when
  /// sim_options::peer_access is false.
  void enable_peer_access(int device, int peer) override;

  // --- gates (see the header comment) ------------------------------------------

  [[nodiscard]] gate_t create_gate(int device) override;
  void wait_gate(int device, stream_t stream, gate_t gate) override;
  void open_gate(int device, gate_t gate) override;
  void destroy_gate(int device, gate_t gate) override;

  // --- simulation controls ----------------------------------------------------

  /// sim_options::host_clock_mode's clock in microseconds; std::nullopt
  /// with host_clock::none. Thread safe.
  [[nodiscard]] std::optional<std::uint64_t> host_time_us() const override;
  /// With host_clock::modeled: the host clock's base becomes `us`
  /// (microseconds; never moves back; the charged virtual-memory costs
  /// stay added). Ignored in the other modes. Thread safe.
  void set_host_time_us(std::uint64_t us);

  /// Current virtual time.
  [[nodiscard]] std::uint64_t now() const;
  /// Advances the clock to `time` (never moves it back).
  void advance_to(std::uint64_t time);
  /// Work queued on `stream` (of `device`) runs until virtual time `until`
  /// (the stream's busy-until becomes max(current, until)). Throws
  /// invalid_argument_error for a handle that is not a stream of `device`
  /// (see "Streams" above; adopt_stream makes one of any handle).
  void enqueue_work(int device, stream_t stream, std::uint64_t until);
  /// Declares that the work queued on `stream` so far uses device memory
  /// [ptr, ptr + size_bytes) (a kernel reading or writing it): it is in use
  /// until that work ends (busy_until(device, stream) now). vm_unmap of a
  /// page of it before then counts in sim_counters::unsafe_unmaps, and a
  /// mapped page of it that another stream's declared work uses at an
  /// overlapping time counts in sim_counters::unsafe_reuses. For tests of
  /// the allocator's page recycling; nothing else changes.
  void use_memory(int device, const void* ptr, std::size_t size_bytes, stream_t stream);
  /// Virtual time at which the work queued on `stream` so far completes;
  /// UINT64_MAX while the stream waits on a closed gate.
  [[nodiscard]] std::uint64_t busy_until(int device, stream_t stream) const;
  /// Changes a device's capacity (bytes); live segments stay.
  void set_capacity(int device, std::size_t capacity_bytes);
  /// The n-th segment_malloc from now (n >= 1) returns nullptr; 0 disarms.
  void fail_segment_malloc_after(std::uint64_t n);
  /// The n-th query_event from now (n >= 1) throws backend_error; 0 disarms.
  void fail_event_query_after(std::uint64_t n);
  /// The n-th vm_create from now (n >= 1) returns false; 0 disarms.
  void fail_vm_create_after(std::uint64_t n);
  /// The n-th vm_map from now (n >= 1) throws backend_error and maps
  /// nothing; 0 disarms.
  void fail_vm_map_after(std::uint64_t n);
  /// The n-th stream_wait_event from now (n >= 1) throws backend_error and
  /// adds no wait; 0 disarms.
  void fail_stream_wait_after(std::uint64_t n);
  /// The n-th vm_unmap from now (n >= 1) throws backend_error and unmaps
  /// nothing; 0 disarms.
  void fail_vm_unmap_after(std::uint64_t n);
  /// The n-th vm_unmap from now (n >= 1) and the count - 1 calls after it
  /// (count calls in a row) throw backend_error and unmap nothing; n = 0 or
  /// count = 0 disarms. Calls rejected for bad arguments do not count.
  /// Thread safe.
  void fail_vm_unmap_after(std::uint64_t n, std::uint64_t count);
  /// Whether `peer` may access the mapped address `addr` of `device`: true
  /// for `device` itself and for peers granted with vm_set_access on that
  /// mapping; false when `addr` is not inside a mapping of `device`. Throws
  /// backend_error for a device index out of range.
  [[nodiscard]] bool peer_can_access(int device, const void* addr, int peer) const;
  /// Whether enable_peer_access(device, peer) was called. Throws
  /// backend_error for an index out of range.
  [[nodiscard]] bool peer_access_enabled(int device, int peer) const;
  [[nodiscard]] sim_counters counters() const;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace ccalloc
