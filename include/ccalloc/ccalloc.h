/* ccalloc/ccalloc.h: ccalloc's C API (plain C99, usable from C and C++).
 *
 * What it is: the caching allocator of <ccalloc/frontend/caching_allocator.hpp>
 * behind C functions, for C programs, for other languages (Python's ctypes,
 * see python/ccalloc), and for PyTorch's torch.cuda.memory.CUDAPluggableAllocator,
 * which loads ccalloc_plugin_alloc / ccalloc_plugin_free (or the ccalloc_torch_* hooks) from
 * libccalloc.so. The shared library needs only libstdc++ and, when built with
 * the CUDA backend, libcudart.
 *
 * Allocators: every function that acts on an allocator takes a
 * `ccalloc_allocator_t*` as its first argument. NULL means the process-wide
 * allocator (ccalloc::global_allocator()): created on first use on the default
 * backend (CUDA when built with it and a GPU is present, else one simulated
 * H200-sized device), initialized for all of the backend's devices, configured
 * from the environment (CCALLOC_CONF, CCALLOC_NO_CACHING), never destroyed.
 * ccalloc_create() makes further allocators with their own backend (for
 * example a simulated device of a chosen size) that ccalloc_destroy() ends.
 *
 * Argument order, fixed: allocator, device, then the subject (size, pointer,
 * fraction, text), then the stream, then output pointers last. (The
 * ccalloc_plugin_* and ccalloc_torch_* entry points have PyTorch's
 * signatures instead.)
 *
 * Errors: no function here throws or aborts (except the ccalloc_torch_* hooks,
 * see their section). Each returns a ccalloc_status_t; on anything but
 * CCALLOC_OK it leaves its outputs unchanged and stores a message naming what
 * was wrong in a thread-local buffer that ccalloc_last_error() returns. The
 * allocator's state is then as before the call (SPEC R5), except after
 * CCALLOC_ERROR_OUT_OF_MEMORY, when cached memory may have been returned to
 * the device while trying. A NULL output pointer is CCALLOC_ERROR_INVALID_ARGUMENT.
 *
 * Pointers: a pointer from ccalloc_malloc is device memory aligned to 512
 * bytes, safe to use on the stream it was allocated on at once, valid until
 * ccalloc_delete (or the allocator's ccalloc_destroy). It belongs to the
 * allocator that made it: free it there. ccalloc_delete is the free of
 * ccalloc_malloc and ccalloc_raw_alloc*; ccalloc_plugin_free (formerly
 * ccalloc_free) is PyTorch's hook, with PyTorch's signature, on the
 * process-wide allocator only.
 *
 * Streams: ccalloc_stream_t is CUDA's cudaStream_t (the same type: a pointer
 * to struct CUstream_st), so a cudaStream_t is passed as is; NULL is the
 * legacy default stream. cudaStreamLegacy means NULL, and cudaStreamPerThread
 * the calling thread's per-thread default stream (each thread's stream has
 * its own cached blocks, as they are different streams). A thread's
 * per-thread stream ends with the thread: the allocator forgets it as
 * ccalloc_stream_destroy does (its live blocks stay valid, its cached blocks
 * pass to other streams, no host memory is kept, also when another thread
 * frees its blocks after it exited), at its next call that
 * takes every lock of the device (a slow-path malloc, statistics,
 * ccalloc_empty_cache), which first waits for that stream's work (CUDA:
 * cudaDeviceSynchronize, as another thread cannot name the stream). On the simulated device a stream is
 * the integer handle from ccalloc_stream_create (NULL: the default stream;
 * the values of cudaStreamLegacy and cudaStreamPerThread, 1 and 2, mean what
 * they mean on CUDA).
 *
 * Thread safety: every function may be called from any thread concurrently,
 * except ccalloc_init and ccalloc_destroy, which must not race with other
 * calls on the same allocator.
 *
 * Fork: fork() may be called while other threads are inside any ccalloc
 * call. Handlers installed with the first allocator (pthread_atfork) take
 * every lock of every allocator before the fork and free them after it, in
 * the parent and the child, so the child's allocators (the process-wide one
 * included) work at once, as the parent's were between two calls: the same
 * live pointers, cache and statistics; blocks that other threads of the
 * parent had cached for reuse go back to the child's pools at its first call
 * that locks the device. The fork itself waits for calls under way to end.
 * On the simulated device the child's device memory is its own copy of the
 * parent's at the fork (expandable and exported segments are copied by the
 * parent before the fork, in time and host memory proportional to their
 * data). A CUDA child cannot use its parent's CUDA context: its device calls
 * fail with a backend error that says so (CCALLOC_ERROR_BACKEND); use spawn.
 * A fork from a callback run under a device's locks (a mapping listener, a
 * private pool's segment allocator, a snapshot's frames callback) takes no
 * lock: that child may call ccalloc only if no other thread was inside it.
 * docs/limitations.md.
 *
 * Cost: malloc and delete are the front end's (a pointer-map lookup and the
 * device allocator's O(log n) pool search); the C layer adds a try/catch.
 *
 * Private pools (SPEC F20, F21, E5) take (allocator, device, pool id, ...):
 * a pool holds its own segments, optionally from the caller's segment
 * allocator (cudaMalloc, ncclMemAlloc), and allocations are routed to it
 * between ccalloc_begin_allocate_to_pool and ccalloc_end_allocate_to_pool.
 * CUDA graph checkpoints (F23, F24) are C++ only.
 */
#ifndef CCALLOC_CCALLOC_H
#define CCALLOC_CCALLOC_H

#include <stddef.h>
#include <stdint.h>

/* Exported from libccalloc.so, whose other symbols are hidden. */
#if defined(__GNUC__)
#define CCALLOC_API __attribute__((visibility("default")))
#else
#define CCALLOC_API
#endif

/* Marks a name kept only for compatibility (GCC and Clang warn on use). */
#if defined(__GNUC__)
#define CCALLOC_DEPRECATED(msg) __attribute__((deprecated(msg)))
#else
#define CCALLOC_DEPRECATED(msg)
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- types ------------------------------------------------------------------ */

/** An allocator made by ccalloc_create (opaque). NULL: the process-wide one. */
typedef struct ccalloc_allocator ccalloc_allocator_t;

/** A stream: CUDA's cudaStream_t (NULL = the legacy default stream). */
typedef struct CUstream_st* ccalloc_stream_t;

/** What a function returned. Messages: ccalloc_last_error(). */
typedef enum ccalloc_status {
  CCALLOC_OK = 0,
  /** Bad argument: unknown or freed pointer, device out of range, fraction
   * outside [0, 1], NULL output pointer; or a call at a time it is not
   * allowed: allocator not initialized, a call from a mapping listener. */
  CCALLOC_ERROR_INVALID_ARGUMENT = 1,
  /** The device could not provide the memory even after the cache was freed
   * (SPEC B6); the message gives the figures. */
  CCALLOC_ERROR_OUT_OF_MEMORY = 2,
  /** A configuration string (or CCALLOC_CONF) has a bad key or value; the
   * message names the key, the value and what is accepted. */
  CCALLOC_ERROR_CONFIG = 3,
  /** The device backend failed (a CUDA error, an unsupported operation). */
  CCALLOC_ERROR_BACKEND = 4,
  /** Anything else (for example host memory exhausted inside the library). */
  CCALLOC_ERROR_INTERNAL = 5
} ccalloc_status_t;

/** Which device backend ccalloc_create uses. */
typedef enum ccalloc_backend_kind {
  /** CUDA when built with it and a GPU is present, else the simulated device. */
  CCALLOC_BACKEND_DEFAULT = 0,
  /** The simulated device (host address space, a virtual clock). */
  CCALLOC_BACKEND_SIM = 1,
  /** CUDA; CCALLOC_ERROR_BACKEND when not built with it or no GPU is seen. */
  CCALLOC_BACKEND_CUDA = 2
} ccalloc_backend_kind_t;

/** The most devices an allocator drives (ccalloc_init) and a simulated
 * backend makes (sim_device_count): 1024. */
#define CCALLOC_MAX_DEVICE_COUNT 1024

/** Options of ccalloc_create. Fill with ccalloc_options_init first: fields
 * may be added at the end in later versions, and struct_size tells the
 * library which ones the caller knows. */
typedef struct ccalloc_options {
  size_t struct_size;             /**< sizeof(ccalloc_options_t), set by ccalloc_options_init */
  ccalloc_backend_kind_t backend; /**< default CCALLOC_BACKEND_DEFAULT */
  int sim_device_count;           /**< simulated devices, default 1 (1 to CCALLOC_MAX_DEVICE_COUNT) */
  size_t sim_capacity_bytes;      /**< bytes per simulated device; 0 = 141 GB (an H200's) */
  /** NULL (default): configuration from the environment, as the process-wide
   * allocator (CCALLOC_CONF, CCALLOC_NO_CACHING). Otherwise this string in
   * PyTorch's syntax ("" = the defaults), and no environment is read. */
  const char* config;
} ccalloc_options_t;

/** Called on each out-of-memory error (SPEC F17), outside the allocator's
 * locks, with the user_data given at attach time, the device, the bytes
 * asked, the bytes allowed (memory-fraction cap, else device total) and the
 * device's free bytes. It may call back into the allocator; an
 * out-of-memory error inside an observer, on the thread running it (an
 * observer that allocates), calls no observer again (it returns
 * CCALLOC_ERROR_OUT_OF_MEMORY to the observer as usual), so an observer
 * cannot recurse without end. */
typedef void (*ccalloc_oom_observer_fn)(void* user_data, int device, size_t requested_bytes,
                                        size_t allowed_bytes, size_t free_bytes);

/** What a trace entry records (PyTorch's TraceEntry::Action, in its order;
 * CCALLOC_TRACE_EMPTY_CACHE, PAUSE and RESUME are ccalloc's own). */
typedef enum ccalloc_trace_action {
  CCALLOC_TRACE_ALLOC = 0,
  CCALLOC_TRACE_FREE_REQUESTED = 1,
  CCALLOC_TRACE_FREE_COMPLETED = 2,
  CCALLOC_TRACE_SEGMENT_ALLOC = 3,
  CCALLOC_TRACE_SEGMENT_FREE = 4,
  CCALLOC_TRACE_SEGMENT_MAP = 5,
  CCALLOC_TRACE_SEGMENT_UNMAP = 6,
  CCALLOC_TRACE_SNAPSHOT = 7,
  CCALLOC_TRACE_OOM = 8,
  CCALLOC_TRACE_EMPTY_CACHE = 9,
  CCALLOC_TRACE_PAUSE = 10,  /**< a tag paused (ccalloc_pause) */
  CCALLOC_TRACE_RESUME = 11  /**< a tag resumed (ccalloc_resume) */
} ccalloc_trace_action_t;

/** One trace entry (ccalloc/core/history.hpp: trace_entry). */
typedef struct ccalloc_trace_entry {
  ccalloc_trace_action_t action;
  int device;
  uintptr_t addr;     /**< for CCALLOC_TRACE_OOM: the device's free bytes */
  size_t size_bytes;  /**< requested bytes for alloc/free entries, else segment or page bytes */
  ccalloc_stream_t stream;
  uint64_t time_us;   /**< microseconds since the Unix epoch */
} ccalloc_trace_entry_t;

/** Called with every trace entry of every device, recorded or not, on the
 * thread that caused it, after the allocator released its locks (it may call
 * back into the allocator). `entry` is valid during the call only. */
typedef void (*ccalloc_trace_tracker_fn)(void* user_data, const ccalloc_trace_entry_t* entry);

/** What changed in a mapping announcement (ccalloc/core/mapping_events.hpp). */
typedef enum ccalloc_mapping_change {
  CCALLOC_MAPPING_MAP = 0,             /**< the range is mapped (announced after) */
  CCALLOC_MAPPING_UNMAP = 1,           /**< the range stops being mapped (announced before) */
  CCALLOC_MAPPING_MOVE = 2,            /**< the range stays mapped, now owned by `stream` */
  CCALLOC_MAPPING_UNMAP_COMPLETED = 3  /**< a deferred unmap was done; no change of what is mapped */
} ccalloc_mapping_change_t;

/** Why (mapping_reason in ccalloc/core/mapping_events.hpp, same order). */
typedef enum ccalloc_mapping_reason {
  CCALLOC_MAPPING_SEGMENT_ALLOC = 0,
  CCALLOC_MAPPING_SEGMENT_FREE = 1,
  CCALLOC_MAPPING_PAGES_MAPPED = 2,
  CCALLOC_MAPPING_PAGES_RECYCLED = 3,
  CCALLOC_MAPPING_PAGES_RELEASED = 4,
  CCALLOC_MAPPING_PAGES_RETIRED = 5,
  CCALLOC_MAPPING_RESERVATION_MOVED = 6,
  CCALLOC_MAPPING_DEFERRED_UNMAP = 7,
  CCALLOC_MAPPING_PAGES_PAUSED = 8,
  CCALLOC_MAPPING_PAGES_RESUMED = 9
} ccalloc_mapping_reason_t;

/** One mapping announcement: [addr, addr + size_bytes) on `device`. */
typedef struct ccalloc_mapping_event {
  ccalloc_mapping_change_t change;
  ccalloc_mapping_reason_t reason;
  int device;
  int expandable; /**< 1: pages of an expandable segment; 0: a whole plain segment */
  uintptr_t addr;
  size_t size_bytes;
  ccalloc_stream_t stream;
} ccalloc_mapping_event_t;

/** Called at every change of what is mapped, synchronously, under the
 * device's locks: a map after it, an unmap before it. It must not call into
 * the allocator (deadlock) and should return quickly. `event` is valid
 * during the call only. */
typedef void (*ccalloc_mapping_listener_fn)(void* user_data, const ccalloc_mapping_event_t* event);

/* ---- errors and identity ------------------------------------------------------ */

/** The message of the last failed call on this thread ("" if none failed
 * yet). Owned by the library; valid until the next failing call on this
 * thread. Successful calls leave it unchanged. */
CCALLOC_API const char* ccalloc_last_error(void);
/** A status as text, e.g. "CCALLOC_ERROR_OUT_OF_MEMORY"; static storage. */
CCALLOC_API const char* ccalloc_status_name(ccalloc_status_t status);
/** "ccalloc" (PyTorch: name(), SPEC F29); static storage. */
CCALLOC_API const char* ccalloc_name(void);
/** The library's version, e.g. "0.1.0"; static storage. */
CCALLOC_API const char* ccalloc_version(void);
/** 1 when the library includes the CUDA backend, else 0. */
CCALLOC_API int ccalloc_built_with_cuda(void);

/* ---- allocators ----------------------------------------------------------------- */

/** Sets `options` to the defaults (struct_size = sizeof(ccalloc_options_t)). */
CCALLOC_API void ccalloc_options_init(ccalloc_options_t* options);
/** Creates an allocator with its own backend, not yet initialized (call
 * ccalloc_init). `options` may be NULL (the defaults). Errors: INVALID_ARGUMENT
 * (bad option), CONFIG (bad configuration string), BACKEND (CUDA asked but
 * unavailable). Configuration warnings (settings without effect, SPEC X6) go
 * to stderr, one line each: "ccalloc: warning: <warning>". */
CCALLOC_API ccalloc_status_t ccalloc_create(const ccalloc_options_t* options, ccalloc_allocator_t** out);
/** Destroys an allocator from ccalloc_create: every segment goes back to the
 * device, and its live pointers become invalid. NULL is a no-op (the
 * process-wide allocator is never destroyed). */
CCALLOC_API void ccalloc_destroy(ccalloc_allocator_t* alloc);
/** Creates the per-device allocators for devices [0, device_count) (SPEC F1).
 * Again with the same count: no-op; a larger count adds devices. Errors:
 * INVALID_ARGUMENT when device_count < 1 or above the backend's count. */
CCALLOC_API ccalloc_status_t ccalloc_init(ccalloc_allocator_t* alloc, int device_count);
/** *out = 1 after ccalloc_init, else 0 (PyTorch: initialized). */
CCALLOC_API ccalloc_status_t ccalloc_initialized(ccalloc_allocator_t* alloc, int* out);
/** Number of devices the allocator's backend drives. */
CCALLOC_API ccalloc_status_t ccalloc_device_count(ccalloc_allocator_t* alloc, int* out);
/** The backend's name, "cuda" or "sim"; valid as long as the allocator. */
CCALLOC_API ccalloc_status_t ccalloc_backend_name(ccalloc_allocator_t* alloc, const char** out);
/** The calling thread's current device on the backend (cudaGetDevice). */
CCALLOC_API ccalloc_status_t ccalloc_current_device(ccalloc_allocator_t* alloc, int* out);
/** Free and total bytes of `device` (cudaMemGetInfo; the simulated device's
 * capacity minus its segments). */
CCALLOC_API ccalloc_status_t ccalloc_mem_get_info(ccalloc_allocator_t* alloc, int device, size_t* free_bytes,
                                                  size_t* total_bytes);

/* ---- allocation (SPEC F2-F5) ------------------------------------------------------ */

/** Allocates `size_bytes` on `device` for use on `stream` (front end malloc,
 * SPEC F2). Size 0 gives *out = NULL and CCALLOC_OK. Errors: INVALID_ARGUMENT
 * (uninitialized, bad device; a stream that is not a live stream of the
 * device, naming it: destroyed by ccalloc_stream_destroy, or, on the
 * simulated device, never created; on CUDA another device's stream or a
 * handle the driver reports invalid, asked once per stream met: a handle
 * never created or destroyed behind ccalloc's back is undefined for CUDA),
 * OUT_OF_MEMORY (also at once for >= 1 EiB), BACKEND. */
CCALLOC_API ccalloc_status_t ccalloc_malloc(ccalloc_allocator_t* alloc, int device, size_t size_bytes,
                                            ccalloc_stream_t stream, void** out);
/** Frees a pointer from this allocator: the free of ccalloc_malloc and
 * ccalloc_raw_alloc* (SPEC F3; PyTorch: raw_delete / free).
 * NULL is a no-op. Errors: INVALID_ARGUMENT naming the pointer when it is not
 * a live allocation of this allocator (never allocated here, freed already,
 * or interior); nothing changes then. Stream ordering: the block is reused at
 * once on its allocation stream, and on streams recorded with
 * ccalloc_record_stream only after their work queued before this call. */
CCALLOC_API ccalloc_status_t ccalloc_delete(ccalloc_allocator_t* alloc, void* ptr);
/** malloc on the current device and the thread's current stream
 * (ccalloc_set_current_stream) (PyTorch: raw_alloc, SPEC F5). */
CCALLOC_API ccalloc_status_t ccalloc_raw_alloc(ccalloc_allocator_t* alloc, size_t size_bytes, void** out);
/** malloc on the current device and `stream` (PyTorch: raw_alloc_with_stream). */
CCALLOC_API ccalloc_status_t ccalloc_raw_alloc_with_stream(ccalloc_allocator_t* alloc, size_t size_bytes,
                                                           ccalloc_stream_t stream, void** out);
/** The calling thread's current stream for ccalloc_raw_alloc, shared by all
 * allocators of the process (default NULL). Never fails. */
CCALLOC_API void ccalloc_set_current_stream(ccalloc_stream_t stream);
CCALLOC_API ccalloc_stream_t ccalloc_current_stream(void);

/** The block holding `ptr` is not reused until the work queued on `stream`
 * before its free has completed (PyTorch: recordStream, SPEC F11). `ptr` may
 * point inside a live block (SPEC X4). A pointer of no live block of this
 * allocator, and NULL, are ignored (CCALLOC_OK). Errors: INVALID_ARGUMENT
 * naming the stream, nothing changed, when `stream` is not a live stream of
 * the block's device (destroyed, never created, another device's; on the
 * simulated device; on CUDA another device's stream or a handle the driver
 * reports invalid) and not the block's own stream; BACKEND. */
CCALLOC_API ccalloc_status_t ccalloc_record_stream(ccalloc_allocator_t* alloc, void* ptr, ccalloc_stream_t stream);
/** Base address and size in bytes of the segment holding `ptr`, a pointer this
 * allocator returned (PyTorch: getBaseAllocation, SPEC F10). Errors:
 * INVALID_ARGUMENT naming the pointer otherwise. */
CCALLOC_API ccalloc_status_t ccalloc_get_base_allocation(ccalloc_allocator_t* alloc, void* ptr, void** base,
                                                         size_t* size_bytes);

/* ---- cache and limits (SPEC F6-F9) --------------------------------------------------- */

/** Returns every unused cached segment of every device to the device, after
 * the events it must wait for; live blocks are untouched (PyTorch:
 * emptyCache, SPEC F8). A segment free that fails (a device, a pool's
 * segment source) does not stop it: the other segments of every device go
 * back, that segment stays cached, and the first failure is reported.
 * Errors: BACKEND. */
CCALLOC_API ccalloc_status_t ccalloc_empty_cache(ccalloc_allocator_t* alloc);
/** *out = size in bytes of `device`'s largest cached free block (PyTorch:
 * cacheInfo, SPEC F9). */
CCALLOC_API ccalloc_status_t ccalloc_cache_info(ccalloc_allocator_t* alloc, int device, size_t* largest_block_bytes);
/** Caps `device`'s reserved bytes at fraction x device total (PyTorch:
 * setMemoryFraction, SPEC F7). Errors: INVALID_ARGUMENT for a fraction
 * outside [0, 1] (or NaN) or a bad device. */
CCALLOC_API ccalloc_status_t ccalloc_set_memory_fraction(ccalloc_allocator_t* alloc, int device, double fraction);
/** *out = `device`'s memory fraction (1 when none was set). */
CCALLOC_API ccalloc_status_t ccalloc_get_memory_fraction(ccalloc_allocator_t* alloc, int device, double* out);
/** Turns caching on (1) or off (0) on every device (PyTorch: enable, SPEC
 * F6). Off: each allocation goes straight to the device and back, and the
 * cache is released. */
CCALLOC_API ccalloc_status_t ccalloc_enable(ccalloc_allocator_t* alloc, int enabled);
/** *out = 1 when caching is on (PyTorch: isEnabled). */
CCALLOC_API ccalloc_status_t ccalloc_is_enabled(ccalloc_allocator_t* alloc, int* out);

/* ---- statistics (SPEC F12, B9) ----------------------------------------------------------- */

/** Number of statistics, the same for every device and allocator. */
CCALLOC_API size_t ccalloc_stat_count(void);
/** Name of statistic `index` (< ccalloc_stat_count()), with the flat key names
 * of torch.cuda.memory_stats(), in sorted order: "active.all.allocated", ...,
 * "allocated_bytes.all.peak", ..., "reserved_bytes.large_pool.current", ...;
 * static storage. NULL for an index out of range. */
CCALLOC_API const char* ccalloc_stat_name(size_t index);
/** Writes `device`'s statistics to values[0 .. ccalloc_stat_count()), in
 * ccalloc_stat_name order (bytes for *_bytes keys and max_split_size (-1:
 * unlimited), counts otherwise). `capacity` is the length of `values`.
 * Errors: INVALID_ARGUMENT when capacity < ccalloc_stat_count() or for a bad
 * device. */
CCALLOC_API ccalloc_status_t ccalloc_get_device_stats(ccalloc_allocator_t* alloc, int device, int64_t* values,
                                                      size_t capacity);
/** One statistic by name, e.g. "reserved_bytes.all.peak". Errors:
 * INVALID_ARGUMENT for an unknown name or a bad device. */
CCALLOC_API ccalloc_status_t ccalloc_get_device_stat(ccalloc_allocator_t* alloc, int device, const char* name,
                                                     int64_t* out);
/** Zeroes the "allocated"/"freed" fields and the event counters (num_ooms,
 * num_alloc_retries, ...) of `device` (PyTorch: resetAccumulatedStats). */
CCALLOC_API ccalloc_status_t ccalloc_reset_accumulated_stats(ccalloc_allocator_t* alloc, int device);
/** Sets every peak of `device` to its current value (PyTorch: resetPeakStats). */
CCALLOC_API ccalloc_status_t ccalloc_reset_peak_stats(ccalloc_allocator_t* alloc, int device);

/* ---- memory history and snapshots (SPEC F13, F14, E4) ---------------------------------------- */

/** Starts (enabled != 0) or stops (enabled == 0) recording the memory history
 * of every device (PyTorch: torch.cuda.memory._record_memory_history): a
 * ring buffer that keeps the newest `max_entries` (> 0) trace entries per
 * device (alloc, free_requested, free_completed, segment_alloc/free/map/unmap,
 * snapshot, oom, empty_cache), timestamps in microseconds. No context (stack):
 * ccalloc_record_history_ex takes a recorder. Stopping drops the entries.
 * Errors: INVALID_ARGUMENT for max_entries 0. Thread safe. */
CCALLOC_API ccalloc_status_t ccalloc_record_history(ccalloc_allocator_t* alloc, int enabled, size_t max_entries);

/** When the context recorder of ccalloc_record_history_ex is called
 * (PyTorch's RecordContext; the `when` of torch.cuda.memory._record_memory_history). */
typedef enum {
  CCALLOC_RECORD_CONTEXT_NEVER = 0, /**< never */
  CCALLOC_RECORD_CONTEXT_STATE = 1, /**< at malloc; kept with the live block (snapshot frames only) */
  CCALLOC_RECORD_CONTEXT_ALLOC = 2, /**< also on the alloc and segment entries of the trace */
  CCALLOC_RECORD_CONTEXT_ALL = 3    /**< also called at free, on the free entries */
} ccalloc_record_context_t;

/** Receives one frame of a context, innermost first (PyTorch's frame: name,
 * filename, line). The strings are copied before it returns; NULL reads as "". */
typedef void (*ccalloc_frame_sink_fn)(void* sink_data, const char* name, const char* filename, int64_t line);

/** Arguments of ccalloc_record_history_ex (PyTorch's recordHistory). Fill
 * it with ccalloc_history_options_init, then set what differs.
 * Contexts: `record` (may be NULL: no contexts) is called on the thread of
 * each malloc (when >= STATE) and free (when == ALL) outside the
 * allocator's locks, and returns an opaque context handle (NULL: none).
 * The allocator keeps the handle with the entries and live blocks it
 * belongs to and calls `release` (may be NULL) once the last of them is
 * dropped, on whatever thread drops it. `frames` (may be NULL: no frames)
 * is called only when a snapshot is written (ccalloc_snapshot_json, the
 * oom_snapshot file), once per entry or block that holds the handle, and
 * emits its frames through `sink`. `release` and `frames` may run while
 * the calling thread holds the allocator's locks: they must not call into
 * any ccalloc allocator. A call from them that would lock a device fails
 * with CCALLOC_ERROR_INVALID_ARGUMENT ("ccalloc: ...: called from the
 * history's release function (ccalloc_history_options_t.release), ...")
 * with nothing changed; ccalloc_malloc and ccalloc_delete, whose fast path
 * takes no such check, stop the process where they would wait on a lock
 * the thread holds, as from a mapping listener (and with its message).
 * `record` runs outside the locks: a malloc or free it makes works, and is
 * recorded without a context (`record` is not called again from inside
 * itself). `user_data` is passed to each and must outlive every handle. */
typedef struct {
  int enabled;            /**< nonzero: record (default 1); 0: stop and drop what was recorded */
  size_t max_entries;     /**< ring-buffer capacity per device, > 0 (default SIZE_MAX) */
  int when;               /**< a ccalloc_record_context_t (default ALL) */
  int clear;              /**< nonzero: drop what was recorded so far (default 0) */
  const char* skip_actions; /**< comma-separated action names not stored, e.g. "free_requested,segment_map"
                                 (NULL or "": none; default NULL) */
  void* (*record)(void* user_data);
  void (*release)(void* user_data, void* context);
  void (*frames)(void* user_data, void* context, ccalloc_frame_sink_fn sink, void* sink_data);
  void* user_data;
} ccalloc_history_options_t;

/** Sets `options` to its defaults (see each field). NULL does nothing. */
CCALLOC_API void ccalloc_history_options_init(ccalloc_history_options_t* options);

/** ccalloc_record_history with PyTorch's full recordHistory arguments:
 * contexts (stacks) through the caller's recorder, `when`, `clear` and
 * `skip_actions` (see ccalloc_history_options_t). With history off the
 * recorder is never called and malloc/free pay nothing for it. Errors:
 * INVALID_ARGUMENT for NULL options, max_entries 0, `when` out of range or
 * an unknown action name in skip_actions (named in the message); nothing
 * changes then. Thread safe. */
CCALLOC_API ccalloc_status_t ccalloc_record_history_ex(ccalloc_allocator_t* alloc,
                                                       const ccalloc_history_options_t* options);
/** The allocator's snapshot (SPEC F13) as UTF-8 JSON with the keys and
 * nesting of PyTorch's torch.cuda.memory._snapshot() (segments with their
 * blocks, device_traces when include_traces != 0, allocator_settings,
 * external_annotations); python/ccalloc/snapshot.py writes it as the pickle
 * PyTorch's viewers read. snprintf-style, as ccalloc_get_config: writes at
 * most capacity - 1 bytes and a NUL to `buffer` (NULL when capacity is 0)
 * and sets *length to the full length without the NUL; call once with
 * capacity 0 to learn the size, then with capacity *length + 1. With
 * history recorded, the `snapshot` entry PyTorch records for each snapshot
 * is recorded only by a call whose buffer held the whole text, after the
 * text was made: it shows in the next snapshot, and the size query changes
 * nothing, so the second call fits unless other threads allocate or free
 * in between (then call again while *length >= capacity). Errors:
 * INVALID_ARGUMENT for a NULL length or a NULL buffer with capacity > 0.
 * Thread safe; locks each device while it walks it. */
CCALLOC_API ccalloc_status_t ccalloc_snapshot_json(ccalloc_allocator_t* alloc, int include_traces, char* buffer,
                                                   size_t capacity, size_t* length);

/* ---- configuration (SPEC F30) --------------------------------------------------------------- */

/** Applies a configuration string in PyTorch's syntax on top of the current
 * configuration of every device, e.g. "max_split_size_mb:128,
 * garbage_collection_threshold:0.6". Errors: CONFIG naming the key, the
 * value and what is accepted; nothing changes then. Warnings about settings
 * without effect (SPEC X6) go to stderr: those this call adds (a warning
 * that earlier settings had already printed is not printed again). */
CCALLOC_API ccalloc_status_t ccalloc_set_config(ccalloc_allocator_t* alloc, const char* text);
/** The configuration in force as a canonical string that ccalloc_set_config
 * accepts, snprintf-style: writes at most capacity - 1 characters and a NUL
 * to `buffer` (which may be NULL when capacity is 0) and sets *length to the
 * full length without the NUL; a call with capacity <= *length truncated.
 * expandable_segments is always named, with the value in force (when not
 * set: True where the backend has virtual memory, else False). */
CCALLOC_API ccalloc_status_t ccalloc_get_config(ccalloc_allocator_t* alloc, char* buffer, size_t capacity,
                                                size_t* length);

/* ---- observers (SPEC F17) ------------------------------------------------------------------- */

/** Registers `fn` for out-of-memory errors on every device, current and
 * future (see ccalloc_oom_observer_fn). `user_data` is passed back as is and
 * must stay valid as long as the allocator. Observers cannot be detached. */
CCALLOC_API ccalloc_status_t ccalloc_attach_out_of_memory_observer(ccalloc_allocator_t* alloc,
                                                                   ccalloc_oom_observer_fn fn, void* user_data);

/** Registers `fn` for every trace entry of every device, current and future,
 * whether history is recorded or not (SPEC F18; PyTorch's
 * attachAllocatorTraceTracker; see ccalloc_trace_tracker_fn). `user_data`
 * must stay valid as long as the allocator. Trackers cannot be detached.
 * CCALLOC_ERROR_INVALID_ARGUMENT for a NULL fn. */
CCALLOC_API ccalloc_status_t ccalloc_attach_trace_tracker(ccalloc_allocator_t* alloc, ccalloc_trace_tracker_fn fn,
                                                          void* user_data);
/** Registers `fn` for every change of what any device has mapped from now
 * on (SPEC C1; see ccalloc_mapping_listener_fn and
 * ccalloc/core/mapping_events.hpp for the order and the reasons). Nothing is
 * announced for what was mapped before. `user_data` must stay valid as long
 * as the allocator. Listeners cannot be detached.
 * CCALLOC_ERROR_INVALID_ARGUMENT for a NULL fn. A listener must not call
 * into any allocator: the announcing thread holds the device's locks. The
 * calls that take them all first (ccalloc_empty_cache, ccalloc_init,
 * ccalloc_enable, ccalloc_set_config, ccalloc_record_history,
 * ccalloc_snapshot_json, ccalloc_mapped_segments, ccalloc_cache_info,
 * ccalloc_pause, ccalloc_create_pool, ...) return
 * CCALLOC_ERROR_INVALID_ARGUMENT ("... a listener must not call into any
 * ccalloc allocator ...") with nothing changed; ccalloc_malloc and
 * ccalloc_delete, which take a stream's lock first, stop the process with
 * that message instead of deadlocking (ccalloc/core/mapping_events.hpp). */
CCALLOC_API ccalloc_status_t ccalloc_attach_mapping_listener(ccalloc_allocator_t* alloc,
                                                             ccalloc_mapping_listener_fn fn, void* user_data);

/** Stops (enabled = 0) or restarts (enabled != 0) the calls of every
 * observing callback of the process, for all allocators at once: trace
 * trackers, mapping listeners, out-of-memory observers, and the `record`,
 * `release` and `frames` functions of ccalloc_record_history_ex. Made for a
 * language runtime's shutdown: CPython ends a daemon thread that calls into
 * Python while the interpreter finalizes (pthread_exit), which would stop
 * the process from inside a callback; the Python package stops the
 * callbacks at interpreter exit (atexit). While stopped, the allocators
 * work as before, but trackers, listeners and observers miss what happens,
 * entries and blocks are recorded without a context, a context recorded
 * earlier is dropped without its `release` (its handle is leaked) and
 * snapshots show no frames for it.
 * Stopping returns once no other thread is inside one of these callbacks,
 * or after `timeout_ms` milliseconds; `still_running` (may be NULL)
 * receives the number of calls still inside then (0: none; a callback that
 * calls this counts its own call out). Restarting returns at once (0).
 * Thread-safe; never fails (CCALLOC_OK). Not in PyTorch's allocator, whose
 * callbacks run on regardless. */
CCALLOC_API ccalloc_status_t ccalloc_set_observers_enabled(int enabled, uint32_t timeout_ms, size_t* still_running);

/* ---- private pools (SPEC F20, F21, E5; PyTorch's MemPool) ---------------------------------------
 *
 * A private pool holds its own segments: an allocation routed to it (see
 * ccalloc_begin_allocate_to_pool) is carved from them, and its free returns
 * the block there; nothing else allocates from them. Pools are per device:
 * the same id on two devices names two pools. Blocks stay bound to their
 * stream as in the default pool. While the pool's use count is above 0 its
 * segments stay (addresses a CUDA graph or an NCCL communicator holds stay
 * valid); at use count 0 its cached segments go back to the device (or to
 * its segment allocator's free) at the next ccalloc_empty_cache or
 * out-of-memory retry, and the pool disappears when it holds no segment.
 * Semantics in <ccalloc/core/device_caching_allocator.hpp> ("private pools").
 * Every function here locks the whole device briefly; all are thread-safe.
 * Errors, for each: INVALID_ARGUMENT (device out of range or not
 * initialized, unknown pool, NULL output) with nothing changed. */

/** Identifies a private pool of a device: PyTorch's MempoolId_t, a pair of
 * integers. User pools are {n, 0} (ccalloc_new_pool_id), CUDA graph pools
 * {0, n}; {0, 0} is the device's default pool and never a private one. */
typedef struct {
  uint64_t first;
  uint64_t second;
} ccalloc_mempool_id_t;

/** A pool's segment source, malloc half: stores `size_bytes` (> 0: a
 * segment size, 2 MiB, 20 MiB or a larger multiple of 2 MiB; in no-caching
 * mode the rounded request, a multiple of 512 bytes) of device memory usable on every stream
 * of the pool's device in *ptr and returns 0, or returns nonzero when it
 * cannot. The signature of cudaMalloc and ncclMemAlloc (whose enum return
 * types, cudaError_t and ncclResult_t, are int-sized: pass them with a cast,
 * `(ccalloc_segment_malloc_fn)ncclMemAlloc`, or as addresses from Python).
 * Called with the pool's device made current (cudaSetDevice; restored
 * after), on the allocating thread, with the device's locks held: it must not
 * call into this allocator. A nonzero return (and a 0 return with *ptr NULL)
 * counts as out of memory whatever the code: the allocator frees its cache,
 * retries once, then fails with CCALLOC_ERROR_OUT_OF_MEMORY, whose message
 * ends with the last nonzero code. The memory must be aligned to 512 bytes
 * (else CCALLOC_ERROR_BACKEND, after giving it back). */
typedef int (*ccalloc_segment_malloc_fn)(void** ptr, size_t size_bytes);
/** The free half: returns a pointer the malloc half gave; 0 = success. The
 * signature of cudaFree and ncclMemFree (with a cast, as above). Called with
 * the device current and the device's locks held, when a cached segment of
 * the pool goes back (ccalloc_empty_cache after the pool's release, an
 * out-of-memory retry, ccalloc_destroy). A nonzero return is
 * CCALLOC_ERROR_BACKEND naming the code, from the call that freed; the
 * segment then stays cached in the pool (the next empty_cache tries again),
 * except in ccalloc_destroy, which cannot report it. */
typedef int (*ccalloc_segment_free_fn)(void* ptr);

/** Bytes and blocks a pool holds now (ccalloc_pool_usage). Invariants:
 * allocated_bytes <= active_bytes <= reserved_bytes. */
typedef struct {
  size_t segment_count;    /**< segments of the pool */
  size_t reserved_bytes;   /**< bytes of those segments (mapped bytes of expandable ones) */
  size_t allocated_bytes;  /**< sizes (rounded) of the blocks allocated from the pool now */
  size_t active_bytes;     /**< allocated + blocks freed but waiting on events of other streams */
  size_t allocation_count; /**< blocks allocated from the pool now */
  int use_count;           /**< ccalloc_create_pool calls minus ccalloc_release_pool calls */
} ccalloc_pool_usage_t;

/** *out = a pool id no earlier call of this process returned: {n, 0} with n
 * = 1, 2, 3, ... (PyTorch: MemPool's id counter). Only an id; no pool is
 * created. The counter is shared by every allocator of the process and never
 * fails (except for a NULL `out`). Thread-safe. */
CCALLOC_API ccalloc_status_t ccalloc_new_pool_id(ccalloc_allocator_t* alloc, ccalloc_mempool_id_t* out);
/** Creates pool `id` on `device` with use count 1, or adds 1 to the use count
 * of an existing one (PyTorch: createOrIncrefPool). `malloc_fn`/`free_fn`:
 * the pool's segment source (see ccalloc_segment_malloc_fn), used only when
 * the pool is created (an existing pool keeps its own); both NULL = the
 * backend's segments (cudaMalloc, or expandable segments when configured).
 * A pool with a segment source has plain segments only; their bytes count as
 * reserved memory of the device like any other. The functions must stay
 * callable until the pool is gone (or the allocator destroyed). Errors:
 * INVALID_ARGUMENT for id {0, 0} and for exactly one of the two functions
 * NULL. */
CCALLOC_API ccalloc_status_t ccalloc_create_pool(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id,
                                                 ccalloc_segment_malloc_fn malloc_fn,
                                                 ccalloc_segment_free_fn free_fn);
/** Subtracts 1 from the use count of pool `id` (PyTorch: releasePool); see
 * the section comment for what happens at 0. Errors: INVALID_ARGUMENT for an
 * unknown pool and for one already at use count 0. */
CCALLOC_API ccalloc_status_t ccalloc_release_pool(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id);
/** *out = the use count of pool `id`; 0 for a released or unknown pool
 * (PyTorch: getPoolUseCount). */
CCALLOC_API ccalloc_status_t ccalloc_pool_use_count(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id,
                                                    int* out);
/** From now on, allocations on `device` go to pool `id` when made on
 * `stream` (all_streams == 0; NULL = the legacy default stream), or on any
 * stream of the device (all_streams != 0; `stream` is ignored) (PyTorch:
 * beginAllocateToPool with a stream filter; PyTorch's torch.cuda.use_mem_pool
 * routes the calling thread's allocations on any stream instead, while
 * ccalloc.torch.use_mem_pool routes the current stream). Calls nest: the
 * most recent active begin that takes the stream wins. While any begin is
 * active on the device the allocator neither queries nor waits for events
 * nor frees device memory (CUDA graph capture rules; SPEC F21): end it
 * promptly. Errors: INVALID_ARGUMENT for an unknown pool or one at use count 0. */
CCALLOC_API ccalloc_status_t ccalloc_begin_allocate_to_pool(ccalloc_allocator_t* alloc, int device,
                                                            ccalloc_mempool_id_t id, ccalloc_stream_t stream,
                                                            int all_streams);
/** Ends the most recent ccalloc_begin_allocate_to_pool of pool `id` on
 * `device` (PyTorch: endAllocateToPool). Errors: INVALID_ARGUMENT when none
 * is active for that pool (never begun, or ended already). */
CCALLOC_API ccalloc_status_t ccalloc_end_allocate_to_pool(ccalloc_allocator_t* alloc, int device,
                                                          ccalloc_mempool_id_t id);
/** *out = what pool `id` of `device` holds now; id {0, 0} gives the device's
 * default pool (use_count 0). Locks the device while it walks its segments:
 * O(segments). Errors: INVALID_ARGUMENT for an unknown pool. */
CCALLOC_API ccalloc_status_t ccalloc_pool_usage(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id,
                                                ccalloc_pool_usage_t* out);

/** One range of device memory a segment has mapped now (ccalloc_mapped_segments):
 * a whole plain segment, or one contiguous mapped range of an expandable
 * reservation, as PyTorch's CUDACachingAllocator::snapshot() reports
 * expandable segments. */
typedef struct {
  int device;               /**< the device it is on */
  uintptr_t address;        /**< first byte of the range */
  size_t total_bytes;       /**< bytes of the range (a multiple of 2 MiB for expandable ones) */
  size_t allocated_bytes;   /**< bytes of the blocks allocated in the range now */
  size_t active_bytes;      /**< allocated + blocks freed but waiting on events of other streams */
  size_t requested_bytes;   /**< bytes asked for by the callers of the active blocks */
  ccalloc_stream_t stream;  /**< the stream whose pool holds the segment */
  int is_large;             /**< 1: large pool (blocks > 1 MiB); 0: small pool */
  int is_expandable;        /**< 1: a range of an expandable reservation; 0: a plain segment */
  ccalloc_mempool_id_t pool_id; /**< the private pool holding it; {0, 0}: the default pool */
} ccalloc_mapped_segment_t;

/** The ranges of device memory mapped now on `device` (-1: every device),
 * ordered by device then address: what a communication library registers
 * (NCCL's ncclCommRegister, ProcessGroupNCCL's register hook reads PyTorch's
 * snapshot the same way). Writes min(*count, needed) entries to `out` (out may
 * be NULL when *count is 0) and sets *count to the number of ranges there
 * are: call with *count 0 first to size `out`. Paused ranges are not mapped
 * and not listed. Thread-safe; locks each device while it walks its
 * segments: O(segments + blocks). Errors: INVALID_ARGUMENT for a NULL count,
 * a NULL out with *count > 0, or a device out of range. */
CCALLOC_API ccalloc_status_t ccalloc_mapped_segments(ccalloc_allocator_t* alloc, int device,
                                                     ccalloc_mapped_segment_t* out, size_t* count);

/* ---- sleep and wake: tags, pause, resume (SPEC S1-S5) ---------------------------------------------
 *
 * Every allocation carries a tag: the one the calling thread's innermost
 * ccalloc_tag_begin set ("default" outside every scope). A named tag's memory
 * lives in reservations of its own (no page holds two tags' blocks), so that
 * ccalloc_pause can release its device pages while keeping its addresses and
 * ccalloc_resume can map them again. Reference: SGLang's torch_memory_saver
 * (region / pause / resume) and vLLM's sleep mode; the semantics are in
 * include/ccalloc/core/device_caching_allocator.hpp (pause, resume) and
 * docs/sleep-wake.md. Thread safety: the scope functions are per
 * thread; pause, resume and ccalloc_tag_usage lock the device(s). */

/** What one pause or resume did (bytes; host_time_us: the backend's host
 * clock across the call, 0 without one). */
typedef struct {
  size_t released_bytes;       /**< pause: device bytes unmapped (paused pages + the tags' cached pages) */
  size_t paused_bytes;         /**< pages under live blocks unmapped (pause) or mapped again (resume) */
  size_t copied_bytes;         /**< bytes copied to (pause) or from (resume) pinned host memory */
  size_t cache_released_bytes; /**< resume: cached memory of active tags given back first */
  uint64_t host_time_us;
} ccalloc_sleep_result_t;

/** One tag's memory on one device (bytes). allocated counts paused blocks
 * (they stay their callers'); reserved counts mapped pages only. */
typedef struct {
  size_t allocated_bytes;
  size_t reserved_bytes;
  size_t paused_bytes;
  size_t kept_bytes; /**< part of paused_bytes held in host memory */
  size_t segments;
  size_t blocks;
  int paused;
} ccalloc_tag_usage_t;

/** Opens a tag scope on the calling thread: allocations it makes until the
 * matching ccalloc_tag_end carry `tag` (1-64 characters of letters, digits
 * and _-.:/). Scopes nest. Errors: INVALID_ARGUMENT for a NULL or bad name
 * (nothing opened). */
CCALLOC_API ccalloc_status_t ccalloc_tag_begin(const char* tag);
/** Closes the calling thread's innermost scope that ccalloc_tag_begin opened.
 * Errors: INVALID_ARGUMENT when it has none open. */
CCALLOC_API ccalloc_status_t ccalloc_tag_end(void);
/** Closes the calling thread's innermost open scope of `tag` that
 * ccalloc_tag_begin opened, even when scopes opened after it are still open
 * (a Python generator or coroutine leaving its `with` while its caller is
 * inside another scope): those stay open, and the thread's tag becomes what
 * it would be had the closed scope never opened (the innermost remaining
 * scope's, or the tag from before the outermost). Scopes of one name are
 * interchangeable, so the innermost of them closes. Python's `with
 * ccalloc.tag(name)` ends its scope with this. O(open scopes) on this
 * thread; allocates nothing. Errors: INVALID_ARGUMENT (nothing changes) for
 * a NULL tag, when no scope of `tag` is open on the calling thread, or when
 * a C++ tag_scope opened after that scope is still open (reopening the
 * scopes above it would lose its tag). */
CCALLOC_API ccalloc_status_t ccalloc_tag_end_named(const char* tag);
/** The calling thread's tag ("default" outside every scope); the string
 * lives as long as the process. */
CCALLOC_API const char* ccalloc_current_tag(void);
/** Pauses tags[0..tag_count) on `device`, or on every device when device is
 * -1, keeping their contents in pinned host memory when keep_contents is
 * nonzero. `out` may be NULL. Errors: INVALID_ARGUMENT ("default", an unknown
 * tag, a graph capture underway, no virtual memory); OUT_OF_MEMORY when the
 * host lacks memory for the contents (nothing paused). */
CCALLOC_API ccalloc_status_t ccalloc_pause(ccalloc_allocator_t* alloc, int device, const char* const* tags,
                                           size_t tag_count, int keep_contents, ccalloc_sleep_result_t* out);
/** Resumes tags[0..tag_count) on `device` (-1: every device): pages mapped
 * again at the same addresses, contents restored. Errors: OUT_OF_MEMORY,
 * naming the tag and the bytes, with the tags still paused (free memory and
 * call it again); INVALID_ARGUMENT for an unknown tag. */
CCALLOC_API ccalloc_status_t ccalloc_resume(ccalloc_allocator_t* alloc, int device, const char* const* tags,
                                            size_t tag_count, ccalloc_sleep_result_t* out);
/** *out = what `tag` holds on `device` now (all zero for a tag that never
 * allocated there or holds nothing). A tag that holds nothing costs the
 * device nothing: its pool and address-space reservation are given back
 * once its last cached page goes (page recycling, ccalloc_empty_cache), so a
 * tag per request or job keeps the process flat; the name stays usable
 * (about 100 bytes each for the life of the process) and makes a fresh tag.
 * Errors: INVALID_ARGUMENT for a bad device or name. */
CCALLOC_API ccalloc_status_t ccalloc_tag_usage(ccalloc_allocator_t* alloc, int device, const char* tag,
                                               ccalloc_tag_usage_t* out);

/* ---- pools for PyTorch's CUDAAllocator interface (SPEC F20-F24) ----------------------------------
 *
 * What an adapter implementing PyTorch's c10::cuda::CUDACachingAllocator::
 * CUDAAllocator (python/ccalloc/csrc/torch_allocator.cpp) needs beyond the
 * functions above: a stream filter and a segment source with user data,
 * live-allocation checks and checkpoints (CUDA graph trees). Same locking,
 * errors and thread safety as the pool functions above. */

/** Decides whether an allocation on `stream` goes to the pool: nonzero =
 * yes. Called on the allocating thread with the device's lock held: fast,
 * no calls into the allocator. `stream` is the stream the allocation named,
 * with cudaStreamLegacy given as NULL (the same stream); cudaStreamPerThread
 * comes as itself (the allocating thread's). */
typedef int (*ccalloc_stream_filter_fn)(void* user_data, ccalloc_stream_t stream);
/** Called once when a filter given to ccalloc_begin_allocate_to_pool_filter
 * is dropped (its end_allocate_to_pool, or the allocator's destruction). */
typedef void (*ccalloc_user_data_release_fn)(void* user_data);

/** As ccalloc_begin_allocate_to_pool, with the streams chosen by `filter`
 * (PyTorch: beginAllocateToPool's std::function filter, e.g. "this thread"
 * for torch.cuda.use_mem_pool or "streams capturing into this graph" for
 * CUDA graphs). `release` (may be NULL) is called with `user_data` once the
 * filter is no longer needed, also when this call fails. Errors:
 * INVALID_ARGUMENT for a NULL filter, an unknown pool or one at use count 0. */
CCALLOC_API ccalloc_status_t ccalloc_begin_allocate_to_pool_filter(ccalloc_allocator_t* alloc, int device,
                                                                   ccalloc_mempool_id_t id,
                                                                   ccalloc_stream_filter_fn filter, void* user_data,
                                                                   ccalloc_user_data_release_fn release);

/** A pool's segment source with user data: malloc half (see
 * ccalloc_segment_malloc_fn for the contract; `user_data` first). */
typedef int (*ccalloc_segment_malloc_ud_fn)(void* user_data, void** ptr, size_t size_bytes);
/** The free half (see ccalloc_segment_free_fn). */
typedef int (*ccalloc_segment_free_ud_fn)(void* user_data, void* ptr);

/** As ccalloc_create_pool with a segment source that takes `user_data`
 * (PyTorch: createOrIncrefPool with a CUDAAllocator, e.g. a MemPool of a
 * CUDAPluggableAllocator over ncclMemAlloc). `user_data` must stay valid
 * until the pool is gone (or the allocator destroyed). Errors:
 * INVALID_ARGUMENT for id {0, 0} or a NULL function. */
CCALLOC_API ccalloc_status_t ccalloc_create_pool_with_source(ccalloc_allocator_t* alloc, int device,
                                                             ccalloc_mempool_id_t id,
                                                             ccalloc_segment_malloc_ud_fn malloc_fn,
                                                             ccalloc_segment_free_ud_fn free_fn, void* user_data);

/** Blocks of pool `id` are handed out by the default pool's out-of-memory
 * path too (enabled != 0; PyTorch: setUseOnOOM). */
CCALLOC_API ccalloc_status_t ccalloc_set_use_on_oom(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id,
                                                    int enabled);
/** Blocks of pool `id` are never split (PyTorch: setNoSplit). */
CCALLOC_API ccalloc_status_t ccalloc_set_no_split(ccalloc_allocator_t* alloc, int device, ccalloc_mempool_id_t id,
                                                  int enabled);

/** *out = 1 iff the blocks allocated from pool `id` now are exactly the
 * `count` pointers at `ptrs` (order and duplicates ignored; an unknown pool
 * has none), else 0 (PyTorch: checkPoolLiveAllocations). */
CCALLOC_API ccalloc_status_t ccalloc_check_pool_live_allocations(ccalloc_allocator_t* alloc, int device,
                                                                 ccalloc_mempool_id_t id, void* const* ptrs,
                                                                 size_t count, int* out);

/** A pool's layout (segments and blocks) at one moment (opaque). */
typedef struct ccalloc_pool_checkpoint ccalloc_pool_checkpoint_t;
/** *out = the layout of pool `id` now (PyTorch: getCheckpointState); the
 * caller owns it: ccalloc_pool_checkpoint_destroy. */
CCALLOC_API ccalloc_status_t ccalloc_get_checkpoint_state(ccalloc_allocator_t* alloc, int device,
                                                          ccalloc_mempool_id_t id, ccalloc_pool_checkpoint_t** out);
/** Frees a checkpoint (NULL: no-op). */
CCALLOC_API void ccalloc_pool_checkpoint_destroy(ccalloc_pool_checkpoint_t* checkpoint);
/** Called by ccalloc_set_checkpoint_pool_state for each pointer it freed
 * (created == 0; the caller must not free it) and each block it allocated
 * (created != 0; the caller owns it: free it once with ccalloc_delete),
 * with the block's size in bytes. */
typedef void (*ccalloc_checkpoint_block_fn)(void* user_data, void* ptr, size_t size_bytes, int created);
/** Restores the pool of `checkpoint` on `device` to its layout (PyTorch:
 * setCheckpointPoolState) and reports each freed and created block to
 * `on_block` (may be NULL) after the restore. Errors: INVALID_ARGUMENT,
 * changing nothing, for a checkpoint of another device or whose segments
 * no longer match. */
CCALLOC_API ccalloc_status_t ccalloc_set_checkpoint_pool_state(ccalloc_allocator_t* alloc, int device,
                                                               const ccalloc_pool_checkpoint_t* checkpoint,
                                                               ccalloc_checkpoint_block_fn on_block, void* user_data);

/** Lets `device` access `peer`'s memory, plain and expandable segments
 * (PyTorch: enablePeerAccess(dev, dev_to_access)). Errors: INVALID_ARGUMENT
 * for equal or uninitialized devices, BACKEND when the GPUs cannot. */
CCALLOC_API ccalloc_status_t ccalloc_enable_peer_access(ccalloc_allocator_t* alloc, int device, int peer);

/* ---- streams of the allocator's backend ----------------------------------------------------- */

/** Creates a stream on `device` of the allocator's backend (CUDA:
 * cudaStreamCreateWithFlags(cudaStreamNonBlocking)); for programs that
 * have no CUDA runtime code of their own and for the simulated device.
 * Destroy it with ccalloc_stream_destroy. Errors: INVALID_ARGUMENT for a
 * NULL `out`, BACKEND from the device (a device out of range). */
CCALLOC_API ccalloc_status_t ccalloc_stream_create(ccalloc_allocator_t* alloc, int device, ccalloc_stream_t* out);
/** Destroys `stream` of `device` (CUDA: cudaStreamDestroy), telling the
 * allocator first: the work queued on the stream completes (the call waits
 * for it), and blocks allocated on it or recorded on it
 * (ccalloc_record_stream) stay valid; their ccalloc_delete later succeeds
 * and records nothing on the destroyed stream. Cached blocks of the stream
 * stay cached (another stream's allocation may take them over;
 * ccalloc_empty_cache returns them); once none is left, the allocator keeps
 * nothing of the stream (no host memory, no time in later calls). With
 * reuse_across_streams:False (for expandable segments also with
 * trim_on_new_peak:False) no other stream may take them over: they go
 * back to the device in this call, as ccalloc_empty_cache returns them, and
 * a segment holding live blocks of the stream when the last of them is
 * freed (a block recorded on other streams once their work has run).
 * A ccalloc_malloc on the
 * destroyed stream fails with INVALID_ARGUMENT in every thread, once this
 * call has returned; one racing with it is served or refused, and its
 * block frees as any other (blocks outlive their streams). Destroying
 * a stream behind the allocator's back (cudaStreamDestroy directly) while
 * blocks of it are live is not supported: their ccalloc_delete may fail and
 * keep the block. Errors: INVALID_ARGUMENT for the default stream or a
 * handle that is not a live stream of `device` (simulated device),
 * BACKEND from the device; nothing changes then. */
CCALLOC_API ccalloc_status_t ccalloc_stream_destroy(ccalloc_allocator_t* alloc, int device, ccalloc_stream_t stream);
/** Blocks until the work queued on `stream` has completed (cudaStreamSynchronize). */
CCALLOC_API ccalloc_status_t ccalloc_stream_synchronize(ccalloc_allocator_t* alloc, int device,
                                                        ccalloc_stream_t stream);

/* ---- PyTorch's CUDAPluggableAllocator signatures (process-wide allocator) --------------------- */

/** PyTorch's alloc_fn signature, `void*(size_t, int, cudaStream_t)`, on the
 * process-wide allocator: ccalloc_malloc(NULL, device, size, stream). Returns
 * NULL for size 0 and on failure (message: ccalloc_last_error()); never
 * throws. Note that PyTorch does not check the result: python/ccalloc
 * installs ccalloc_torch_alloc instead, which raises. */
CCALLOC_API void* ccalloc_plugin_alloc(size_t size, int device, ccalloc_stream_t stream);
/** PyTorch's free_fn signature, `void(void*, size_t, int, cudaStream_t)`:
 * ccalloc_delete(NULL, ptr); `size`, `device` and `stream` are not needed
 * (ccalloc knows them) and ignored. An error is printed to stderr (a free has
 * no way to report it) and kept for ccalloc_last_error(). Never throws. */
CCALLOC_API void ccalloc_plugin_free(void* ptr, size_t size, int device, ccalloc_stream_t stream);
/** The names ccalloc_plugin_alloc and ccalloc_plugin_free had before 0.2,
 * still exported with the same behaviour for programs and PyTorch set-ups
 * that load them by name. Deprecated: "ccalloc_free" read as the free of
 * ccalloc_malloc, which it is not (that is ccalloc_delete). */
CCALLOC_API CCALLOC_DEPRECATED("use ccalloc_plugin_alloc (PyTorch's alloc_fn) or ccalloc_malloc") void* ccalloc_alloc(
    size_t size, int device, ccalloc_stream_t stream);
CCALLOC_API CCALLOC_DEPRECATED("use ccalloc_delete to free a ccalloc_malloc pointer; ccalloc_plugin_free is PyTorch's "
                               "free_fn") void ccalloc_free(void* ptr, size_t size, int device,
                                                            ccalloc_stream_t stream);

/* ---- inter-process sharing (SPEC F25, C3) ----------------------------------------------
 *
 * The producer shares a live block (ccalloc_share_ipc_handle), sends the
 * handle's bytes and descriptors to another process (ccalloc_send_ipc_handle
 * over a connected AF_UNIX SOCK_SEQPACKET socket, or any SCM_RIGHTS
 * transport), which opens it (ccalloc_open_ipc_handle) and later closes it
 * (ccalloc_close_ipc_handle). Blocks of expandable segments: every share of
 * a block returns the same handle; the consumer maps only the block's pages;
 * the producer's ccalloc_delete of a block that a live consumer holds is
 * deferred (the block stays allocated, its pages mapped) until no live
 * process holds it, then freed by the next ccalloc_empty_cache or
 * ccalloc_reclaim_ipc_exports; a consumer that dies without closing stops
 * holding. Blocks of plain segments: the producer must keep the block until
 * every consumer has closed it. docs/design.md, "IPC of expandable memory". */

/** A shared block: the handle's bytes (binary, may hold NUL bytes) and the
 * file descriptors that go with it, in order. Filled in by
 * ccalloc_share_ipc_handle and ccalloc_receive_ipc_handle; the memory is the
 * library's (release it with ccalloc_ipc_export_free), the descriptors the
 * caller's. */
typedef struct ccalloc_ipc_export_t {
  char* handle;
  size_t handle_bytes;
  int* fds;
  size_t fd_count;
} ccalloc_ipc_export_t;

/** Shares the live block at `ptr` (a pointer ccalloc_malloc returned) into
 * *out (PyTorch: shareIpcHandle). Errors: INVALID_ARGUMENT naming the
 * pointer when it is not a live block's start, or when the block is under a
 * named tag; BACKEND when the backend cannot share its kind of segment. */
CCALLOC_API ccalloc_status_t ccalloc_share_ipc_handle(ccalloc_allocator_t* alloc, void* ptr,
                                                      ccalloc_ipc_export_t* out);
/** Frees the memory of *ex (from ccalloc_share_ipc_handle or
 * ccalloc_receive_ipc_handle) and, when `close_fds` is nonzero, closes its
 * descriptors; then zeroes *ex. NULL does nothing. Never fails. */
CCALLOC_API void ccalloc_ipc_export_free(ccalloc_ipc_export_t* ex, int close_fds);
/** Sends *ex on the connected Unix socket `socket` (the descriptors as
 * SCM_RIGHTS; they stay the caller's). Errors: INVALID_ARGUMENT for a
 * handle over 64 KiB or an export with no handle bytes (one that
 * ccalloc_ipc_export_free emptied), nothing sent; BACKEND naming errno's
 * text when sending fails. */
CCALLOC_API ccalloc_status_t ccalloc_send_ipc_handle(int socket, const ccalloc_ipc_export_t* ex);
/** Receives one handle sent by ccalloc_send_ipc_handle into *out (blocks
 * until it arrives); the received descriptors are the caller's. Errors:
 * BACKEND when receiving fails or the peer closed the socket. */
CCALLOC_API ccalloc_status_t ccalloc_receive_ipc_handle(int socket, ccalloc_ipc_export_t* out);
/** Opens a handle of another process (PyTorch: getIpcDevPtr): *out = the
 * block's first byte in this process. `fds` (`fd_count` of them, NULL when
 * 0) stay the caller's. `access_device`: the device whose kernels use the
 * mapping, -1 for the handle's device. Opening the same block again returns
 * the same pointer with one more reference. Errors: INVALID_ARGUMENT for a
 * malformed handle (the parser's message), a wrong descriptor count, a
 * device not initialized here; BACKEND when the backend refuses or the
 * producer freed the block before this open. */
CCALLOC_API ccalloc_status_t ccalloc_open_ipc_handle(ccalloc_allocator_t* alloc, const void* handle,
                                                     size_t handle_bytes, const int* fds, size_t fd_count,
                                                     int access_device, void** out);
/** The handle of the block at `ptr` as bytes alone, for transports that
 * carry no descriptors (C++: share_ipc_handle_pidfd): the importer takes the
 * descriptors from this process with pidfd_getfd. Binary (may hold NUL
 * bytes): writes min(*length, capacity) bytes to `buffer` (NULL when
 * capacity is 0; no NUL added) and sets *length to the full size; the bytes
 * are the same on every call for one block, so a first call with capacity 0
 * sizes the buffer. Errors: as ccalloc_share_ipc_handle. */
CCALLOC_API ccalloc_status_t ccalloc_share_ipc_handle_pidfd(ccalloc_allocator_t* alloc, void* ptr, char* buffer,
                                                            size_t capacity, size_t* length);
/** Opens bytes from ccalloc_share_ipc_handle_pidfd of another process
 * (C++: open_ipc_handle_pidfd): *out = the block's first byte here. Errors:
 * INVALID_ARGUMENT for malformed bytes; BACKEND when the exporter is gone,
 * ptrace permission is refused (the message says what to do), or the
 * exporter has freed the block; as ccalloc_open_ipc_handle otherwise. */
CCALLOC_API ccalloc_status_t ccalloc_open_ipc_handle_pidfd(ccalloc_allocator_t* alloc, const void* bytes,
                                                           size_t byte_count, int access_device, void** out);
/** Drops one reference to a pointer from ccalloc_open_ipc_handle; the last
 * unmaps it and lets the producer reclaim the pages. Errors:
 * INVALID_ARGUMENT for any other pointer (an address inside the mapping
 * too: it drops no reference). */
CCALLOC_API ccalloc_status_t ccalloc_close_ipc_handle(ccalloc_allocator_t* alloc, void* ptr);
/** Frees the exported blocks whose free was deferred and that no live
 * process holds any more; *freed (may be NULL) = how many. Errors: BACKEND. */
CCALLOC_API ccalloc_status_t ccalloc_reclaim_ipc_exports(ccalloc_allocator_t* alloc, size_t* freed);
/** For the exported expandable block at `ptr` (shared and not yet really
 * freed, deferred frees included): *importers = live processes holding it,
 * *owner_freed = 1 when the producer's free is waiting for them (either
 * output may be NULL). Errors: INVALID_ARGUMENT when `ptr` is not such a block. */
CCALLOC_API ccalloc_status_t ccalloc_ipc_export_status(ccalloc_allocator_t* alloc, void* ptr, size_t* importers,
                                                       int* owner_freed);

/* ---- hooks for PyTorch (C++ callers only) -----------------------------------------------------
 *
 * What python/ccalloc (ccalloc.torch.install) hands to
 * torch.cuda.memory.CUDAPluggableAllocator and its set_*_fn setters, on the
 * process-wide allocator. Unlike every other function here, those that can
 * fail THROW a C++ exception derived from std::runtime_error
 * (ccalloc::out_of_memory_error, ::invalid_argument_error, ...) because
 * PyTorch ignores return values: PyTorch turns the exception into a Python
 * RuntimeError carrying ccalloc's message (for out of memory, the same text
 * as ccalloc's OOM error; it is not torch.OutOfMemoryError). Do not call them
 * from C. */

/** alloc_fn: as ccalloc_plugin_alloc, but throws instead of returning NULL. */
CCALLOC_API void* ccalloc_torch_alloc(size_t size, int device, ccalloc_stream_t stream);
/** free_fn: as ccalloc_plugin_free (never throws: PyTorch frees in destructors). */
CCALLOC_API void ccalloc_torch_free(void* ptr, size_t size, int device, ccalloc_stream_t stream);
/** init_fn, `void(int device_count)`: creates the process-wide allocator (and
 * its backend) when CUDA initializes, so its start-up cost is not charged to
 * the first allocation. Throws backend_error. */
CCALLOC_API void ccalloc_torch_init(int device_count);
/** reset_fn, `void()`, called by torch.cuda.empty_cache(): ccalloc_empty_cache. */
CCALLOC_API void ccalloc_torch_empty_cache(void);
/** memory_fraction_fn, `void(double, int)`, called by
 * torch.cuda.set_per_process_memory_fraction(fraction, device). */
CCALLOC_API void ccalloc_torch_set_memory_fraction(double fraction, int device);
/** base_alloc_fn, `void*(void*, size_t*)`: the segment base of `ptr`, its
 * size in *size_bytes (PyTorch: getBaseAllocation; used for CUDA IPC). */
CCALLOC_API void* ccalloc_torch_base_alloc(void* ptr, size_t* size_bytes);
/** record_stream_fn, `void(void*, cudaStream_t)`, called by Tensor.record_stream. */
CCALLOC_API void ccalloc_torch_record_stream(void* ptr, ccalloc_stream_t stream);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif /* CCALLOC_CCALLOC_H */
