// The CUDA device backend: the CUDA runtime for memory, streams and events,
// the driver's cuMem* functions (looked up through the runtime, so libcuda is
// never linked) for virtual memory. See include/ccalloc/backend/cuda_backend.hpp.
#include <ccalloc/backend/cuda_backend.hpp>
#include <ccalloc/base/detail/fork_handlers.hpp>
#include <ccalloc/base/detail/pointer_text.hpp>
#include <ccalloc/base/errors.hpp>

// Types and enums only: no driver function is called by name.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <dlfcn.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace ccalloc {

namespace {

// The CUDA runtime, opened when the backend is first asked for (dlopen), as
// PyTorch and NCCL open the driver: a program built with the CUDA backend
// that only uses the simulated device loads and runs where no CUDA library
// is installed. Each runtime function this file calls, by its own name.
#define CCALLOC_CUDART_FUNCTIONS(X) \
  X(cudaDeviceCanAccessPeer) \
  X(cudaDeviceEnablePeerAccess) \
  X(cudaDeviceGetAttribute) \
  X(cudaDeviceSynchronize) \
  X(cudaEventCreateWithFlags) \
  X(cudaEventDestroy) \
  X(cudaEventQuery) \
  X(cudaEventRecord) \
  X(cudaEventSynchronize) \
  X(cudaFree) \
  X(cudaFreeHost) \
  X(cudaGetDevice) \
  X(cudaGetDeviceCount) \
  X(cudaGetDriverEntryPointByVersion) \
  X(cudaGetErrorName) \
  X(cudaGetErrorString) \
  X(cudaGetLastError) \
  X(cudaHostAlloc) \
  X(cudaHostGetDevicePointer) \
  X(cudaIpcCloseMemHandle) \
  X(cudaIpcGetMemHandle) \
  X(cudaIpcOpenMemHandle) \
  X(cudaMalloc) \
  X(cudaMemGetInfo) \
  X(cudaMemcpy) \
  X(cudaMemcpyAsync) \
  X(cudaMemcpyPeerAsync) \
  X(cudaSetDevice) \
  X(cudaStreamCreateWithFlags) \
  X(cudaStreamDestroy) \
  X(cudaStreamGetFlags) \
  X(cudaStreamIsCapturing) \
  X(cudaStreamSynchronize) \
  X(cudaStreamWaitEvent) \
  X(cudaThreadExchangeStreamCaptureMode)

struct cudart_api {
#define CCALLOC_CUDART_POINTER(name) decltype(&::name) name = nullptr;
  CCALLOC_CUDART_FUNCTIONS(CCALLOC_CUDART_POINTER)
#undef CCALLOC_CUDART_POINTER
  /// cudaStreamGetDevice (CUDA 12.8 and later); nullptr in an older runtime.
  cudaError_t (*stream_get_device)(cudaStream_t, int*) = nullptr;
  std::string error;  ///< why the runtime could not be loaded; empty when it was
};

/// The library CCALLOC_CUDART_LIBRARY names when it is set (only that one);
/// else the runtime's soname for the toolkit built against
/// (libcudart.so.13), then the toolkit's own copy (CCALLOC_CUDART_PATH, set
/// by CMake), so a build tree runs without LD_LIBRARY_PATH. A process that
/// loaded a libcudart of the same soname (PyTorch's) shares it.
cudart_api load_cudart() {
  cudart_api api;
  const char* chosen = std::getenv("CCALLOC_CUDART_LIBRARY");
  const std::string soname =
      chosen != nullptr ? std::string(chosen) : "libcudart.so." + std::to_string(CUDART_VERSION / 1000);
  void* lib = ::dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
  std::string why = lib == nullptr ? std::string(::dlerror()) : std::string();
#ifdef CCALLOC_CUDART_PATH
  if (lib == nullptr && chosen == nullptr) {
    lib = ::dlopen(CCALLOC_CUDART_PATH, RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) why += std::string("; ") + ::dlerror();
  }
#endif
  if (lib == nullptr) {
    api.error = "cuda: the CUDA runtime (" + soname + ") could not be loaded: " + why +
                " (install the CUDA runtime or use the simulated device)";
    return api;
  }
  std::string missing;
#define CCALLOC_CUDART_RESOLVE(name)                                          \
  api.name = reinterpret_cast<decltype(&::name)>(::dlsym(lib, #name));       \
  if (api.name == nullptr) missing += (missing.empty() ? "" : ", ") + std::string(#name);
  CCALLOC_CUDART_FUNCTIONS(CCALLOC_CUDART_RESOLVE)
#undef CCALLOC_CUDART_RESOLVE
  // Optional: a runtime of the same soname may be older than the headers.
  api.stream_get_device = reinterpret_cast<cudaError_t (*)(cudaStream_t, int*)>(::dlsym(lib, "cudaStreamGetDevice"));
  if (!missing.empty()) api.error = "cuda: " + soname + " lacks " + missing + " (a CUDA runtime older than the build's)";
  return api;  // the library stays open for the life of the process
}

/// The runtime's functions, loaded on the first call (thread-safe).
const cudart_api& rt() {
  static const cudart_api api = load_cudart();
  return api;
}

/// Throws backend_error when the runtime could not be loaded.
void require_cudart() {
  if (!rt().error.empty()) throw backend_error(rt().error);
}

// The CUDA version whose ABI of each driver symbol we ask for. 12.0 is the
// oldest driver API generation this backend supports; the cuMem* functions
// have had one ABI since 10.2, which the PFN_*_v10020 types below describe.
constexpr unsigned int driver_abi_version = 12000;

// The process that made the first cuda_backend (0: none yet). A child of
// fork() cannot use its parent's CUDA context: its CUDA calls fail, and
// fork_hint() says why in the error.
std::atomic<pid_t> cuda_owner_pid{0};

std::string fork_hint() {
  const pid_t owner = cuda_owner_pid.load(std::memory_order_relaxed);
  if (owner == 0 || owner == ::getpid()) return {};
  return "; this process is a fork() child of process " + std::to_string(owner) +
         ", which initialized CUDA, and a forked child cannot use its parent's CUDA context: start the "
         "process with spawn (Python multiprocessing.get_context(\"spawn\")) or exec";
}

std::string describe_error(cudaError_t e) {
  return std::string(rt().cudaGetErrorName(e)) + " (" + rt().cudaGetErrorString(e) + ")" + fork_hint();
}

using detail::pointer_text;

// Throws backend_error for a failed runtime call. `call` is built only on
// failure (it is a callable returning the call's text with its arguments).
[[noreturn]] void throw_cuda(const std::string& call, cudaError_t e) {
  // Clear the thread's last error so that a non-sticky failure does not
  // resurface from an unrelated later call (sticky errors stay regardless).
  (void)rt().cudaGetLastError();
  throw backend_error("cuda: " + call + " failed: " + describe_error(e));
}

template <class Describe>
void check(cudaError_t e, Describe&& describe) {
  if (e != cudaSuccess) [[unlikely]]
    throw_cuda(describe(), e);
}

std::string dev_text(int device) { return "device " + std::to_string(device); }

// Makes `device` the calling thread's current device for a scope and restores
// the previous one afterwards. With `activate`, cudaSetDevice is called even if
// the device is already current, which makes its primary context current (and
// creates it if needed: CUDA >= 12), as the driver's cuMem* functions expect.
class device_guard {
 public:
  explicit device_guard(int device, bool activate = false) : device_(device) {
    check(rt().cudaGetDevice(&previous_), [] { return std::string("cudaGetDevice()"); });
    if (previous_ != device_ || activate)
      check(rt().cudaSetDevice(device_), [&] { return "cudaSetDevice(" + std::to_string(device_) + ")"; });
  }
  ~device_guard() {
    if (previous_ != device_) (void)rt().cudaSetDevice(previous_);
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;

 private:
  int device_;
  int previous_ = 0;
};

// A stream_t holds a cudaStream_t, except a per-thread default stream
// resolved by resolve_stream: on its own thread that is cudaStreamPerThread;
// another thread cannot name it, and gets the legacy default stream, which
// orders work after all prior work of every blocking stream (the per-thread
// default streams are blocking), so an event recorded there completes no
// earlier than one on the per-thread stream would.
cudaStream_t to_cuda(stream_t s) noexcept {
  if (device_backend::is_per_thread_stream(s)) [[unlikely]]
    return device_backend::is_calling_thread_stream(s) ? cudaStreamPerThread : cudaStreamLegacy;
  return reinterpret_cast<cudaStream_t>(s);
}
// True for a stream another thread's per-thread default stream stands for:
// only waiting for the whole device waits for it from here.
bool foreign_per_thread(stream_t s) noexcept {
  return device_backend::is_per_thread_stream(s) && !device_backend::is_calling_thread_stream(s);
}
// Special and resolved default streams: never destroyed.
bool is_default_stream(stream_t s) noexcept {
  return s == default_stream || s == legacy_stream_handle || s == per_thread_stream_handle ||
         device_backend::is_per_thread_stream(s);
}
cudaEvent_t to_cuda_event(event_t e) noexcept { return reinterpret_cast<cudaEvent_t>(e); }
CUdeviceptr to_cu(const void* p) noexcept { return static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p)); }

// The driver functions this backend calls, looked up once.
struct driver_api {
  PFN_cuInit_v2000 init = nullptr;
  PFN_cuGetErrorName_v6000 get_error_name = nullptr;
  PFN_cuGetErrorString_v6000 get_error_string = nullptr;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetAttribute_v2000 device_get_attribute = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 mem_get_allocation_granularity = nullptr;
  PFN_cuMemAddressReserve_v10020 mem_address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 mem_address_free = nullptr;
  PFN_cuMemCreate_v10020 mem_create = nullptr;
  PFN_cuMemRelease_v10020 mem_release = nullptr;
  PFN_cuMemMap_v10020 mem_map = nullptr;
  PFN_cuMemUnmap_v10020 mem_unmap = nullptr;
  PFN_cuMemSetAccess_v10020 mem_set_access = nullptr;
  // Inter-process sharing of physical memory (optional: resolved on their own).
  PFN_cuMemExportToShareableHandle_v10020 mem_export_to_shareable_handle = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 mem_import_from_shareable_handle = nullptr;
  // Gates (resolved on their own: not part of virtual memory). The v2 ABI
  // (CUDA 11.7), which driver_abi_version 12000 selects.
  PFN_cuStreamWaitValue32_v11070 stream_wait_value32 = nullptr;

  // Looks `symbol` up; leaves `fn` null when the driver lacks it.
  template <class Fn>
  static bool resolve(const char* symbol, Fn& fn) noexcept {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t e = rt().cudaGetDriverEntryPointByVersion(symbol, &p, driver_abi_version, cudaEnableDefault, &status);
    if (e != cudaSuccess || status != cudaDriverEntryPointSuccess || p == nullptr) {
      (void)rt().cudaGetLastError();
      fn = nullptr;
      return false;
    }
    fn = reinterpret_cast<Fn>(p);
    return true;
  }

  // True when every function virtual memory needs was found.
  bool load() noexcept {
    bool ok = true;
    ok &= resolve("cuInit", init);
    // The error texts are optional: messages fall back to the number.
    resolve("cuGetErrorName", get_error_name);
    resolve("cuGetErrorString", get_error_string);
    ok &= resolve("cuDeviceGet", device_get);
    ok &= resolve("cuDeviceGetAttribute", device_get_attribute);
    ok &= resolve("cuMemGetAllocationGranularity", mem_get_allocation_granularity);
    ok &= resolve("cuMemAddressReserve", mem_address_reserve);
    ok &= resolve("cuMemAddressFree", mem_address_free);
    ok &= resolve("cuMemCreate", mem_create);
    ok &= resolve("cuMemRelease", mem_release);
    ok &= resolve("cuMemMap", mem_map);
    ok &= resolve("cuMemUnmap", mem_unmap);
    ok &= resolve("cuMemSetAccess", mem_set_access);
    return ok;
  }

  std::string describe(CUresult r) const {
    const char* name = nullptr;
    const char* text = nullptr;
    if (get_error_name != nullptr && get_error_name(r, &name) != CUDA_SUCCESS) name = nullptr;
    if (get_error_string != nullptr && get_error_string(r, &text) != CUDA_SUCCESS) text = nullptr;
    std::string s = name != nullptr ? std::string(name) : "CUresult " + std::to_string(static_cast<int>(r));
    if (text != nullptr) s += std::string(" (") + text + ")";
    return s + fork_hint();
  }

  template <class Describe>
  void check(CUresult r, Describe&& call) const {
    if (r != CUDA_SUCCESS) [[unlikely]]
      throw backend_error("cuda: " + call() + " failed: " + describe(r));
  }
};

// `shareable`: the memory can be exported as a POSIX file descriptor
// (cuMemExportToShareableHandle), which IPC of expandable segments needs.
// PyTorch does the same for its expandable segments: it asks for
// CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR and falls back to no handle type
// where the driver refuses (containers without the needed permission).
CUmemAllocationProp pinned_device_prop(int device, bool shareable = false) noexcept {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = shareable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
  return prop;
}

CUmemAccessDesc read_write_access(int device) noexcept {
  CUmemAccessDesc desc{};
  desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  desc.location.id = device;
  desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return desc;
}

// Release paths ignore a runtime or driver that is already shutting down.
bool unloading(cudaError_t e) noexcept {
  if (e == cudaErrorCudartUnloading) {
    (void)rt().cudaGetLastError();
    return true;
  }
  return false;
}
bool unloading(CUresult r) noexcept { return r == CUDA_ERROR_DEINITIALIZED; }

}  // namespace

struct cuda_backend::impl {
  int device_count = 0;
  driver_api driver;
  bool virtual_memory = false;
  bool ipc_vm = false;  // physical memory is created exportable as POSIX file descriptors
  bool gates = false;
  mutable std::mutex mutex;                      // guards granularity
  mutable std::vector<std::size_t> granularity;  // per device; 0 = not asked yet

  // Gates: 32-bit words in blocks of pinned, mapped host memory.
  static constexpr std::size_t gate_block_bytes = 4096;
  struct gate_slot {
    int device = 0;
    CUdeviceptr device_address = 0;
    bool live = false;  // handed out by create_gate and not destroyed
  };
  std::mutex gate_mutex;                                // guards the three below
  std::unordered_map<gate_t, gate_slot> gate_slots;     // every word of every block
  std::vector<std::vector<gate_t>> free_gates;          // per device
  std::vector<void*> gate_blocks;                       // cudaHostAlloc'd, freed in ~cuda_backend
  // Around a fork (base/detail/fork_handlers.hpp): both locks, so that the
  // child's calls (which fail: fork_hint) find them free.
  std::optional<detail::fork_registration> fork;

  // The live gate `gate` of `device` (gate_mutex held).
  gate_slot& live_gate(gate_t gate, int device, const char* what) {
    auto it = gate_slots.find(gate);
    if (it == gate_slots.end() || !it->second.live)
      throw backend_error(std::string("cuda: ") + what + ": " + pointer_text(reinterpret_cast<void*>(gate)) +
                          " is not a live gate");
    if (it->second.device != device)
      throw backend_error(std::string("cuda: ") + what + ": gate " + pointer_text(reinterpret_cast<void*>(gate)) +
                          " belongs to " + dev_text(it->second.device) + ", not " + dev_text(device));
    return it->second;
  }
  // The gate's word (the handle is its host address).
  static std::atomic_ref<std::uint32_t> word(gate_t gate) noexcept {
    auto* w = reinterpret_cast<std::uint32_t*>(gate);  // NOLINT(performance-no-int-to-ptr)
    return std::atomic_ref<std::uint32_t>(*w);
  }

  void check_device(int device, const char* what) const {
    if (device < 0 || device >= device_count) [[unlikely]]
      throw backend_error(std::string("cuda: ") + what + ": device " + std::to_string(device) +
                          " is out of range [0, " + std::to_string(device_count) + ")");
  }
};

std::string cuda_backend::runtime_load_error() { return rt().error; }

int cuda_backend::available_device_count() noexcept {
  int n = 0;
  try {
    if (!rt().error.empty()) return 0;  // no CUDA runtime: no devices
  } catch (const std::bad_alloc&) {     // loading it ran out of host memory
    return 0;
  }
  if (rt().cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)rt().cudaGetLastError();
    return 0;
  }
  return n;
}

cuda_backend::cuda_backend() : impl_(std::make_unique<impl>()) {
  require_cudart();
  pid_t none = 0;
  (void)cuda_owner_pid.compare_exchange_strong(none, ::getpid(), std::memory_order_relaxed);
  impl_->fork.emplace(detail::fork_rank::backend, detail::fork_hooks{impl_.get(),
                                                                     [](void* self) noexcept {
                                                                       auto& i = *static_cast<impl*>(self);
                                                                       i.mutex.lock();
                                                                       i.gate_mutex.lock();
                                                                     },
                                                                     [](void* self, bool) noexcept {
                                                                       auto& i = *static_cast<impl*>(self);
                                                                       i.gate_mutex.unlock();
                                                                       i.mutex.unlock();
                                                                     }});
  int n = 0;
  const cudaError_t e = rt().cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)rt().cudaGetLastError();
    throw backend_error("cuda: no usable CUDA device: cudaGetDeviceCount() failed: " + describe_error(e));
  }
  if (n < 1) throw backend_error("cuda: no usable CUDA device: cudaGetDeviceCount() reports 0 devices");
  impl_->device_count = n;
  impl_->granularity.assign(static_cast<std::size_t>(n), 0);

  // Virtual memory: every entry point resolves and every device supports it.
  driver_api& d = impl_->driver;
  bool vm = d.load() && d.init(0) == CUDA_SUCCESS;
  for (int i = 0; vm && i < n; ++i) {
    CUdevice dev = 0;
    int supported = 0;
    vm = d.device_get(&dev, i) == CUDA_SUCCESS &&
         d.device_get_attribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev) ==
             CUDA_SUCCESS &&
         supported != 0;
  }
  impl_->virtual_memory = vm;

  // IPC of expandable segments: both entry points and every device able to
  // export POSIX file descriptors.
  bool ipc_vm = vm && driver_api::resolve("cuMemExportToShareableHandle", d.mem_export_to_shareable_handle) &&
                driver_api::resolve("cuMemImportFromShareableHandle", d.mem_import_from_shareable_handle);
  for (int i = 0; ipc_vm && i < n; ++i) {
    CUdevice dev = 0;
    int supported = 0;
    ipc_vm = d.device_get(&dev, i) == CUDA_SUCCESS &&
             d.device_get_attribute(&supported, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                                    dev) == CUDA_SUCCESS &&
             supported != 0;
  }
  impl_->ipc_vm = ipc_vm;

  // Gates: cuStreamWaitValue32 (v2 memory operations: on by default since
  // CUDA 11.7, no attribute to ask) and host memory mapped into every device.
  bool gates = driver_api::resolve("cuStreamWaitValue32", d.stream_wait_value32);
  for (int i = 0; gates && i < n; ++i) {
    int can_map = 0;
    if (rt().cudaDeviceGetAttribute(&can_map, cudaDevAttrCanMapHostMemory, i) != cudaSuccess) {
      (void)rt().cudaGetLastError();
      can_map = 0;
    }
    gates = can_map != 0;
  }
  impl_->gates = gates;
  impl_->free_gates.resize(static_cast<std::size_t>(n));
}

cuda_backend::~cuda_backend() {
  impl_->fork.reset();  // a fork under way finishes first
  // Gate blocks: errors (the runtime unloading at exit, a reset device) are
  // ignored, the driver reclaims the memory with the process anyway.
  for (void* block : impl_->gate_blocks)
    if (rt().cudaFreeHost(block) != cudaSuccess) (void)rt().cudaGetLastError();
}

backend_capabilities cuda_backend::capabilities() const {
  backend_capabilities c;
  c.virtual_memory = impl_->virtual_memory;
  c.peer_access = true;
  c.ipc = true;
  c.ipc_vm = impl_->ipc_vm;
  c.gates = impl_->gates;
  c.stream_wait = true;
  return c;
}

// --- devices -------------------------------------------------------------------------

int cuda_backend::device_count() const { return impl_->device_count; }

int cuda_backend::current_device() const {
  int device = 0;
  check(rt().cudaGetDevice(&device), [] { return std::string("cudaGetDevice()"); });
  return device;
}

void cuda_backend::set_device(int device) {
  impl_->check_device(device, "set_device");
  check(rt().cudaSetDevice(device), [&] { return "cudaSetDevice(" + std::to_string(device) + ")"; });
}

memory_info cuda_backend::mem_get_info(int device) const {
  impl_->check_device(device, "mem_get_info");
  device_guard guard(device);
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  check(rt().cudaMemGetInfo(&free_bytes, &total_bytes), [&] { return "cudaMemGetInfo(" + dev_text(device) + ")"; });
  return {free_bytes, total_bytes};
}

// --- segments --------------------------------------------------------------------------

void* cuda_backend::segment_malloc(int device, std::size_t size_bytes) {
  impl_->check_device(device, "segment_malloc");
  if (size_bytes == 0) throw backend_error("cuda: segment_malloc of 0 bytes on " + dev_text(device));
  device_guard guard(device);
  void* ptr = nullptr;
  const cudaError_t e = rt().cudaMalloc(&ptr, size_bytes);
  if (e == cudaErrorMemoryAllocation) {
    (void)rt().cudaGetLastError();  // out of memory is an answer, not an error
    return nullptr;
  }
  check(e, [&] { return "cudaMalloc(" + dev_text(device) + ", " + std::to_string(size_bytes) + " bytes)"; });
  return ptr;
}

void cuda_backend::segment_free(int device, void* ptr) {
  impl_->check_device(device, "segment_free");
  device_guard guard(device);
  const cudaError_t e = rt().cudaFree(ptr);
  if (unloading(e)) return;
  check(e, [&] { return "cudaFree(" + dev_text(device) + ", " + pointer_text(ptr) + ")"; });
}

// --- streams and events --------------------------------------------------------------------

stream_t cuda_backend::create_stream(int device) {
  impl_->check_device(device, "create_stream");
  device_guard guard(device);
  cudaStream_t s = nullptr;
  check(rt().cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
        [&] { return "cudaStreamCreateWithFlags(" + dev_text(device) + ", cudaStreamNonBlocking)"; });
  return reinterpret_cast<stream_t>(s);
}

// A handle some code made with cudaStreamCreate* (this backend, PyTorch, the
// program): CUDA tells its device (cudaStreamGetDevice), or with a runtime
// older than 12.8 only that it is a stream (cudaStreamGetFlags). CUDA calls
// a handle never made, or already destroyed, undefined: the driver reports
// most as an invalid handle (then false), but cannot promise to; the
// allocator asks once per stream it meets, not per allocation (SPEC R5).
bool cuda_backend::is_stream(int device, stream_t stream) {
  impl_->check_device(device, "is_stream");
  // The default streams exist on every device. A per-thread handle is the
  // calling thread's own stream, or another thread's, which this thread
  // cannot name (as on the simulated device).
  if (stream == default_stream || stream == legacy_stream_handle || stream == per_thread_stream_handle)
    return true;
  if (device_backend::is_per_thread_stream(stream)) return device_backend::is_calling_thread_stream(stream);
  // During a graph capture (a stream's first allocation is often there),
  // queries of a capturing stream are refused and, in the global capture
  // mode, ruin the capture: the thread's mode is relaxed around them, and a
  // capturing stream is a stream (cudaStreamIsCapturing may be called
  // during a capture; its device is not asked then).
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  const bool mode_exchanged = rt().cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess;
  struct restore_mode {
    bool exchanged;
    cudaStreamCaptureMode& mode;
    ~restore_mode() {
      if (exchanged) (void)rt().cudaThreadExchangeStreamCaptureMode(&mode);
    }
  } restore{mode_exchanged, mode};
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const cudaError_t c = rt().cudaStreamIsCapturing(to_cuda(stream), &capture);
  if (c == cudaErrorInvalidResourceHandle || c == cudaErrorInvalidValue || c == cudaErrorContextIsDestroyed) {
    (void)rt().cudaGetLastError();  // not sticky: no later call should see it
    return false;
  }
  if (c == cudaSuccess && capture != cudaStreamCaptureStatusNone) return true;
  int owner = device;
  unsigned int flags = 0;
  const cudaError_t e = rt().stream_get_device != nullptr ? rt().stream_get_device(to_cuda(stream), &owner)
                                                          : rt().cudaStreamGetFlags(to_cuda(stream), &flags);
  if (e == cudaErrorInvalidResourceHandle || e == cudaErrorInvalidValue || e == cudaErrorContextIsDestroyed) {
    (void)rt().cudaGetLastError();  // not sticky: no later call should see it
    return false;
  }
  check(e, [&] {
    return std::string(rt().stream_get_device != nullptr ? "cudaStreamGetDevice" : "cudaStreamGetFlags") +
           "(stream " + pointer_text(to_cuda(stream)) + ")";
  });
  return owner == device;
}

void cuda_backend::destroy_stream(int device, stream_t stream) {
  impl_->check_device(device, "destroy_stream");
  if (is_default_stream(stream))
    throw backend_error("cuda: destroy_stream: stream " + std::to_string(stream) + " is a default stream of " +
                        dev_text(device) + " and cannot be destroyed");
  device_guard guard(device);
  const cudaError_t e = rt().cudaStreamDestroy(to_cuda(stream));
  if (unloading(e)) return;
  check(e, [&] { return "cudaStreamDestroy(" + dev_text(device) + ", stream " + pointer_text(to_cuda(stream)) + ")"; });
}

event_t cuda_backend::create_event(int device) {
  impl_->check_device(device, "create_event");
  device_guard guard(device);
  cudaEvent_t ev = nullptr;
  check(rt().cudaEventCreateWithFlags(&ev, cudaEventDisableTiming),
        [&] { return "cudaEventCreateWithFlags(" + dev_text(device) + ", cudaEventDisableTiming)"; });
  return reinterpret_cast<event_t>(ev);
}

void cuda_backend::destroy_event(int device, event_t event) {
  impl_->check_device(device, "destroy_event");
  if (event == 0) throw backend_error("cuda: destroy_event: event 0 is not an event");
  device_guard guard(device);
  const cudaError_t e = rt().cudaEventDestroy(to_cuda_event(event));
  if (unloading(e)) return;
  check(e,
        [&] { return "cudaEventDestroy(" + dev_text(device) + ", event " + pointer_text(to_cuda_event(event)) + ")"; });
}

void cuda_backend::record_event(int device, event_t event, stream_t stream) {
  impl_->check_device(device, "record_event");
  if (event == 0) throw backend_error("cuda: record_event: event 0 is not an event");
  auto describe = [&] {
    return "cudaEventRecord(" + dev_text(device) + ", event " + pointer_text(to_cuda_event(event)) + ", stream " +
           pointer_text(to_cuda(stream)) + ")";
  };
  // On `device`: (cudaStream_t)0 means the legacy default stream of the
  // current device, and the event's device must be current (as PyTorch does).
  device_guard guard(device);
  check(rt().cudaEventRecord(to_cuda_event(event), to_cuda(stream)), describe);
}

bool cuda_backend::query_event(int device, event_t event) {
  impl_->check_device(device, "query_event");
  if (event == 0) throw backend_error("cuda: query_event: event 0 is not an event");
  const cudaError_t e = rt().cudaEventQuery(to_cuda_event(event));
  if (e == cudaSuccess) return true;
  if (e == cudaErrorNotReady) {
    (void)rt().cudaGetLastError();  // "not ready" is an answer, not an error
    return false;
  }
  throw_cuda("cudaEventQuery(" + dev_text(device) + ", event " + pointer_text(to_cuda_event(event)) + ")", e);
}

void cuda_backend::synchronize_event(int device, event_t event) {
  impl_->check_device(device, "synchronize_event");
  if (event == 0) throw backend_error("cuda: synchronize_event: event 0 is not an event");
  check(rt().cudaEventSynchronize(to_cuda_event(event)), [&] {
    return "cudaEventSynchronize(" + dev_text(device) + ", event " + pointer_text(to_cuda_event(event)) + ")";
  });
}

void cuda_backend::stream_wait_event(int device, stream_t stream, event_t event) {
  impl_->check_device(device, "stream_wait_event");
  if (event == 0) throw backend_error("cuda: stream_wait_event: event 0 is not an event");
  if (foreign_per_thread(stream))
    throw backend_error("cuda: stream_wait_event: stream " + pointer_text(reinterpret_cast<void*>(stream)) +
                        " is another thread's per-thread default stream, which cannot be named from this thread");
  device_guard guard(device);
  check(rt().cudaStreamWaitEvent(to_cuda(stream), to_cuda_event(event), 0), [&] {
    return "cudaStreamWaitEvent(" + dev_text(device) + ", stream " + pointer_text(to_cuda(stream)) + ", event " +
           pointer_text(to_cuda_event(event)) + ")";
  });
}

void cuda_backend::synchronize_stream(int device, stream_t stream) {
  impl_->check_device(device, "synchronize_stream");
  auto describe = [&] {
    return "cudaStreamSynchronize(" + dev_text(device) + ", stream " + pointer_text(to_cuda(stream)) + ")";
  };
  if (foreign_per_thread(stream)) {
    device_guard guard(device);
    check(rt().cudaDeviceSynchronize(), describe);
  } else if (stream == default_stream || stream == legacy_stream_handle || stream == per_thread_stream_handle ||
             device_backend::is_per_thread_stream(stream)) {
    device_guard guard(device);
    check(rt().cudaStreamSynchronize(to_cuda(stream)), describe);
  } else {
    check(rt().cudaStreamSynchronize(to_cuda(stream)), describe);
  }
}

bool cuda_backend::is_capturing(int device, stream_t stream) {
  impl_->check_device(device, "is_capturing");
  device_guard guard(device);  // (cudaStream_t)0: the current device's legacy default stream
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check(rt().cudaStreamIsCapturing(to_cuda(stream), &status), [&] {
    return "cudaStreamIsCapturing(" + dev_text(device) + ", stream " + pointer_text(to_cuda(stream)) + ")";
  });
  return status != cudaStreamCaptureStatusNone;
}

void cuda_backend::synchronize_device(int device) {
  impl_->check_device(device, "synchronize_device");
  device_guard guard(device);
  check(rt().cudaDeviceSynchronize(), [&] { return "cudaDeviceSynchronize(" + dev_text(device) + ")"; });
}

// --- virtual memory --------------------------------------------------------------------------

std::size_t cuda_backend::vm_granularity(int device) const {
  impl_->check_device(device, "vm_granularity");
  if (!impl_->virtual_memory) throw_not_supported("vm_granularity");
  {
    std::lock_guard lock(impl_->mutex);
    const std::size_t cached = impl_->granularity[static_cast<std::size_t>(device)];
    if (cached != 0) return cached;
  }
  device_guard guard(device, /*activate=*/true);
  const CUmemAllocationProp prop = pinned_device_prop(device);
  std::size_t g = 0;
  impl_->driver.check(impl_->driver.mem_get_allocation_granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                      [&] { return "cuMemGetAllocationGranularity(" + dev_text(device) + ")"; });
  if (g == 0) throw backend_error("cuda: cuMemGetAllocationGranularity(" + dev_text(device) + ") returned 0");
  std::lock_guard lock(impl_->mutex);
  impl_->granularity[static_cast<std::size_t>(device)] = g;
  return g;
}

void* cuda_backend::vm_reserve(int device, std::size_t size_bytes) {
  impl_->check_device(device, "vm_reserve");
  if (!impl_->virtual_memory) throw_not_supported("vm_reserve");
  device_guard guard(device, /*activate=*/true);
  CUdeviceptr ptr = 0;
  const CUresult r = impl_->driver.mem_address_reserve(&ptr, size_bytes, 0, 0, 0);
  if (r == CUDA_ERROR_OUT_OF_MEMORY) return nullptr;
  impl_->driver.check(
      r, [&] { return "cuMemAddressReserve(" + dev_text(device) + ", " + std::to_string(size_bytes) + " bytes)"; });
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(ptr));
}

void cuda_backend::vm_release(int device, void* base, std::size_t size_bytes) {
  impl_->check_device(device, "vm_release");
  if (!impl_->virtual_memory) throw_not_supported("vm_release");
  device_guard guard(device, /*activate=*/true);
  const CUresult r = impl_->driver.mem_address_free(to_cu(base), size_bytes);
  if (unloading(r)) return;
  impl_->driver.check(r, [&] {
    return "cuMemAddressFree(" + dev_text(device) + ", " + pointer_text(base) + ", " + std::to_string(size_bytes) +
           " bytes)";
  });
}

bool cuda_backend::vm_create(int device, std::size_t size_bytes, physical_handle_t* handle) {
  impl_->check_device(device, "vm_create");
  if (!impl_->virtual_memory) throw_not_supported("vm_create");
  if (handle == nullptr) throw backend_error("cuda: vm_create: handle is null");
  device_guard guard(device, /*activate=*/true);
  CUmemGenericAllocationHandle h = 0;
  CUresult r = CUDA_ERROR_NOT_SUPPORTED;
  if (impl_->ipc_vm) {
    const CUmemAllocationProp prop = pinned_device_prop(device, /*shareable=*/true);
    r = impl_->driver.mem_create(&h, size_bytes, &prop, 0);
  }
  // Without a shareable handle type where the driver refuses one (as
  // PyTorch falls back); such a handle cannot be exported.
  if (r == CUDA_ERROR_NOT_SUPPORTED || r == CUDA_ERROR_NOT_PERMITTED || r == CUDA_ERROR_INVALID_VALUE) {
    const CUmemAllocationProp prop = pinned_device_prop(device);
    r = impl_->driver.mem_create(&h, size_bytes, &prop, 0);
  }
  if (r == CUDA_ERROR_OUT_OF_MEMORY) return false;
  impl_->driver.check(
      r, [&] { return "cuMemCreate(" + dev_text(device) + ", " + std::to_string(size_bytes) + " bytes)"; });
  *handle = static_cast<physical_handle_t>(h);
  return true;
}

void cuda_backend::vm_release_handle(int device, physical_handle_t handle) {
  impl_->check_device(device, "vm_release_handle");
  if (!impl_->virtual_memory) throw_not_supported("vm_release_handle");
  device_guard guard(device, /*activate=*/true);
  const CUresult r = impl_->driver.mem_release(static_cast<CUmemGenericAllocationHandle>(handle));
  if (unloading(r)) return;
  impl_->driver.check(r,
                      [&] { return "cuMemRelease(" + dev_text(device) + ", handle " + std::to_string(handle) + ")"; });
}

void cuda_backend::vm_map(int device, void* addr, std::size_t size_bytes, physical_handle_t handle) {
  impl_->check_device(device, "vm_map");
  if (!impl_->virtual_memory) throw_not_supported("vm_map");
  device_guard guard(device, /*activate=*/true);
  const driver_api& d = impl_->driver;
  d.check(d.mem_map(to_cu(addr), size_bytes, 0, static_cast<CUmemGenericAllocationHandle>(handle), 0), [&] {
    return "cuMemMap(" + dev_text(device) + ", " + pointer_text(addr) + ", " + std::to_string(size_bytes) +
           " bytes, handle " + std::to_string(handle) + ")";
  });
  const CUmemAccessDesc desc = read_write_access(device);
  const CUresult r = d.mem_set_access(to_cu(addr), size_bytes, &desc, 1);
  if (r != CUDA_SUCCESS) {
    (void)d.mem_unmap(to_cu(addr), size_bytes);  // leave the range as it was
    d.check(r, [&] {
      return "cuMemSetAccess(" + dev_text(device) + ", " + pointer_text(addr) + ", " + std::to_string(size_bytes) +
             " bytes, read/write for " + dev_text(device) + ")";
    });
  }
}

void cuda_backend::vm_unmap(int device, void* addr, std::size_t size_bytes) {
  impl_->check_device(device, "vm_unmap");
  if (!impl_->virtual_memory) throw_not_supported("vm_unmap");
  device_guard guard(device, /*activate=*/true);
  const CUresult r = impl_->driver.mem_unmap(to_cu(addr), size_bytes);
  if (unloading(r)) return;
  impl_->driver.check(r, [&] {
    return "cuMemUnmap(" + dev_text(device) + ", " + pointer_text(addr) + ", " + std::to_string(size_bytes) + " bytes)";
  });
}

void cuda_backend::vm_set_access(int device, void* addr, std::size_t size_bytes, int peer) {
  impl_->check_device(device, "vm_set_access");
  impl_->check_device(peer, "vm_set_access (peer)");
  if (!impl_->virtual_memory) throw_not_supported("vm_set_access");
  device_guard guard(device, /*activate=*/true);
  const CUmemAccessDesc desc = read_write_access(peer);
  impl_->driver.check(impl_->driver.mem_set_access(to_cu(addr), size_bytes, &desc, 1), [&] {
    return "cuMemSetAccess(" + dev_text(device) + ", " + pointer_text(addr) + ", " + std::to_string(size_bytes) +
           " bytes, read/write for " + dev_text(peer) + ")";
  });
}

// --- inter-process sharing -------------------------------------------------------------------

ipc_mem_handle cuda_backend::ipc_export_segment(int device, void* base) {
  impl_->check_device(device, "ipc_export_segment");
  device_guard guard(device);
  cudaIpcMemHandle_t h{};
  check(rt().cudaIpcGetMemHandle(&h, base),
        [&] { return "cudaIpcGetMemHandle(" + dev_text(device) + ", " + pointer_text(base) + ")"; });
  static_assert(sizeof(h) == sizeof(ipc_mem_handle::bytes), "cudaIpcMemHandle_t is 64 bytes");
  ipc_mem_handle out;
  std::memcpy(out.bytes.data(), &h, sizeof h);
  return out;
}

void* cuda_backend::ipc_open_segment(int device, const ipc_mem_handle& handle) {
  impl_->check_device(device, "ipc_open_segment");
  device_guard guard(device);
  cudaIpcMemHandle_t h{};
  std::memcpy(&h, handle.bytes.data(), sizeof h);
  void* ptr = nullptr;
  check(rt().cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess), [&] {
    return "cudaIpcOpenMemHandle(" + dev_text(device) +
           ", cudaIpcMemLazyEnablePeerAccess) (was the segment freed, or is this the process that exported it?)";
  });
  return ptr;
}

void cuda_backend::ipc_close_segment(int device, void* ptr) {
  impl_->check_device(device, "ipc_close_segment");
  device_guard guard(device);
  const cudaError_t e = rt().cudaIpcCloseMemHandle(ptr);
  if (unloading(e)) return;
  check(e, [&] { return "cudaIpcCloseMemHandle(" + dev_text(device) + ", " + pointer_text(ptr) + ")"; });
}

shareable_handle cuda_backend::vm_export_handle(int device, physical_handle_t handle) {
  impl_->check_device(device, "vm_export_handle");
  if (!impl_->ipc_vm) throw_not_supported("vm_export_handle");
  device_guard guard(device, /*activate=*/true);
  int fd = -1;
  impl_->driver.check(
      impl_->driver.mem_export_to_shareable_handle(&fd, static_cast<CUmemGenericAllocationHandle>(handle),
                                                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
      [&] {
        return "cuMemExportToShareableHandle(" + dev_text(device) + ", handle " + std::to_string(handle) +
               ", CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)";
      });
  // The size is the caller's: cuMemGetAllocationPropertiesFromHandle would
  // not give it either. The front end knows its page size.
  return shareable_handle{fd, 0, 0};
}

physical_handle_t cuda_backend::vm_import_handle(int device, const shareable_handle& shared) {
  impl_->check_device(device, "vm_import_handle");
  if (!impl_->ipc_vm) throw_not_supported("vm_import_handle");
  if (shared.offset_bytes != 0)
    throw backend_error("cuda: vm_import_handle(" + dev_text(device) + ", fd " + std::to_string(shared.fd) +
                        "): offset " + std::to_string(shared.offset_bytes) +
                        " is not 0 (CUDA exports one allocation per descriptor)");
  device_guard guard(device, /*activate=*/true);
  CUmemGenericAllocationHandle h = 0;
  // The driver takes the descriptor's value cast to a pointer; it does not
  // close it.
  impl_->driver.check(impl_->driver.mem_import_from_shareable_handle(
                          &h, reinterpret_cast<void*>(static_cast<std::intptr_t>(shared.fd)),
                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                      [&] {
                        return "cuMemImportFromShareableHandle(" + dev_text(device) + ", fd " +
                               std::to_string(shared.fd) + ", CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)";
                      });
  return static_cast<physical_handle_t>(h);
}

// --- copies ----------------------------------------------------------------------------------

void cuda_backend::memcpy_async(int device, void* dst, const void* src, std::size_t size_bytes, stream_t stream) {
  impl_->check_device(device, "memcpy_async");
  if (size_bytes == 0) return;
  device_guard guard(device);
  check(rt().cudaMemcpyAsync(dst, src, size_bytes, cudaMemcpyDeviceToDevice, to_cuda(stream)), [&] {
    return "cudaMemcpyAsync(" + pointer_text(dst) + ", " + pointer_text(src) + ", " + std::to_string(size_bytes) +
           " bytes, cudaMemcpyDeviceToDevice, " + dev_text(device) + ")";
  });
}

void cuda_backend::memcpy_peer_async(void* dst, int dst_device, const void* src, int src_device,
                                     std::size_t size_bytes, stream_t stream) {
  impl_->check_device(dst_device, "memcpy_peer_async (dst)");
  impl_->check_device(src_device, "memcpy_peer_async (src)");
  if (size_bytes == 0) return;
  check(rt().cudaMemcpyPeerAsync(dst, dst_device, src, src_device, size_bytes, to_cuda(stream)), [&] {
    return "cudaMemcpyPeerAsync(" + pointer_text(dst) + " on " + dev_text(dst_device) + ", " + pointer_text(src) +
           " on " + dev_text(src_device) + ", " + std::to_string(size_bytes) + " bytes)";
  });
}

void cuda_backend::copy_data(int device, void* dst, const void* src, std::size_t size_bytes) {
  impl_->check_device(device, "copy_data");
  if (size_bytes == 0) return;
  device_guard guard(device);
  check(rt().cudaMemcpy(dst, src, size_bytes, cudaMemcpyDeviceToDevice), [&] {
    return "cudaMemcpy(" + pointer_text(dst) + ", " + pointer_text(src) + ", " + std::to_string(size_bytes) +
           " bytes, cudaMemcpyDeviceToDevice)";
  });
}

// --- host memory and host copies -------------------------------------------------------------

void* cuda_backend::host_alloc(int device, std::size_t size_bytes) {
  impl_->check_device(device, "host_alloc");
  if (size_bytes == 0) return nullptr;
  device_guard guard(device);
  void* p = nullptr;
  if (rt().cudaHostAlloc(&p, size_bytes, cudaHostAllocPortable) != cudaSuccess) {
    (void)rt().cudaGetLastError();  // out of pinned memory is an answer, not a sticky error
    return nullptr;
  }
  return p;
}

void cuda_backend::host_free(int, void* ptr) noexcept {
  if (ptr != nullptr) (void)rt().cudaFreeHost(ptr);
}

void cuda_backend::copy_to_host_async(int device, void* host_dst, const void* device_src, std::size_t size_bytes,
                                      stream_t stream) {
  impl_->check_device(device, "copy_to_host_async");
  if (size_bytes == 0) return;
  device_guard guard(device);
  check(rt().cudaMemcpyAsync(host_dst, device_src, size_bytes, cudaMemcpyDeviceToHost, to_cuda(stream)), [&] {
    return "cudaMemcpyAsync(" + pointer_text(host_dst) + ", " + pointer_text(device_src) + ", " +
           std::to_string(size_bytes) + " bytes, cudaMemcpyDeviceToHost, " + dev_text(device) + ")";
  });
}

void cuda_backend::copy_from_host_async(int device, void* device_dst, const void* host_src, std::size_t size_bytes,
                                        stream_t stream) {
  impl_->check_device(device, "copy_from_host_async");
  if (size_bytes == 0) return;
  device_guard guard(device);
  check(rt().cudaMemcpyAsync(device_dst, host_src, size_bytes, cudaMemcpyHostToDevice, to_cuda(stream)), [&] {
    return "cudaMemcpyAsync(" + pointer_text(device_dst) + ", " + pointer_text(host_src) + ", " +
           std::to_string(size_bytes) + " bytes, cudaMemcpyHostToDevice, " + dev_text(device) + ")";
  });
}

// --- peers -----------------------------------------------------------------------------------

bool cuda_backend::can_access_peer(int device, int peer) const {
  impl_->check_device(device, "can_access_peer");
  impl_->check_device(peer, "can_access_peer (peer)");
  if (device == peer) return false;
  int can = 0;
  check(rt().cudaDeviceCanAccessPeer(&can, device, peer),
        [&] { return "cudaDeviceCanAccessPeer(" + dev_text(device) + ", peer " + std::to_string(peer) + ")"; });
  return can != 0;
}

void cuda_backend::enable_peer_access(int device, int peer) {
  impl_->check_device(device, "enable_peer_access");
  impl_->check_device(peer, "enable_peer_access (peer)");
  device_guard guard(device);
  const cudaError_t e = rt().cudaDeviceEnablePeerAccess(peer, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) {
    (void)rt().cudaGetLastError();
    return;
  }
  check(e, [&] { return "cudaDeviceEnablePeerAccess(" + dev_text(device) + ", peer " + std::to_string(peer) + ")"; });
}

// --- gates -----------------------------------------------------------------------------------

gate_t cuda_backend::create_gate(int device) {
  impl_->check_device(device, "create_gate");
  if (!impl_->gates) throw_not_supported("create_gate");
  std::unique_lock lock(impl_->gate_mutex);
  auto& free_list = impl_->free_gates[static_cast<std::size_t>(device)];
  if (free_list.empty()) {
    // A new block, allocated unlocked: cudaHostAlloc may wait for the device,
    // and open_gate (which takes the lock) must stay callable meanwhile.
    lock.unlock();
    void* block = nullptr;
    void* device_address = nullptr;
    {
      device_guard guard(device);
      check(rt().cudaHostAlloc(&block, impl::gate_block_bytes, cudaHostAllocMapped | cudaHostAllocPortable), [&] {
        return "cudaHostAlloc(" + dev_text(device) + ", " + std::to_string(impl::gate_block_bytes) +
               " bytes, cudaHostAllocMapped | cudaHostAllocPortable)";
      });
      const cudaError_t e = rt().cudaHostGetDevicePointer(&device_address, block, 0);
      if (e != cudaSuccess) {
        (void)rt().cudaFreeHost(block);
        throw_cuda("cudaHostGetDevicePointer(" + dev_text(device) + ", " + pointer_text(block) + ")", e);
      }
    }
    lock.lock();
    impl_->gate_blocks.push_back(block);
    constexpr std::size_t words = impl::gate_block_bytes / sizeof(std::uint32_t);
    // Handed out from the front of the block: the free list is a stack.
    for (std::size_t i = words; i-- > 0;) {
      const auto gate = reinterpret_cast<gate_t>(static_cast<std::uint32_t*>(block) + i);
      impl::word(gate).store(1, std::memory_order_relaxed);
      impl_->gate_slots[gate] = impl::gate_slot{
          device, to_cu(device_address) + static_cast<CUdeviceptr>(i * sizeof(std::uint32_t)), false};
      free_list.push_back(gate);
    }
  }
  const gate_t gate = free_list.back();
  free_list.pop_back();
  impl_->gate_slots.at(gate).live = true;
  // Closed. Ordered before any wait on it: wait_gate enqueues after this
  // store, through a driver call that synchronizes with the GPU's reads.
  impl::word(gate).store(0, std::memory_order_release);
  return gate;
}

void cuda_backend::wait_gate(int device, stream_t stream, gate_t gate) {
  impl_->check_device(device, "wait_gate");
  if (!impl_->gates) throw_not_supported("wait_gate");
  CUdeviceptr address = 0;
  {
    std::lock_guard lock(impl_->gate_mutex);
    address = impl_->live_gate(gate, device, "wait_gate").device_address;
  }
  // On `device`: stream 0 is the legacy default stream of the current context.
  device_guard guard(device, /*activate=*/true);
  impl_->driver.check(
      impl_->driver.stream_wait_value32(reinterpret_cast<CUstream>(to_cuda(stream)), address, 1,
                                        CU_STREAM_WAIT_VALUE_GEQ),
      [&] {
        return "cuStreamWaitValue32(" + dev_text(device) + ", stream " + pointer_text(to_cuda(stream)) + ", gate " +
               pointer_text(reinterpret_cast<void*>(gate)) + ", 1, CU_STREAM_WAIT_VALUE_GEQ)";
      });
}

void cuda_backend::open_gate(int device, gate_t gate) {
  impl_->check_device(device, "open_gate");
  if (!impl_->gates) throw_not_supported("open_gate");
  std::lock_guard lock(impl_->gate_mutex);
  (void)impl_->live_gate(gate, device, "open_gate");
  impl::word(gate).store(1, std::memory_order_release);
}

void cuda_backend::destroy_gate(int device, gate_t gate) {
  impl_->check_device(device, "destroy_gate");
  if (!impl_->gates) throw_not_supported("destroy_gate");
  std::lock_guard lock(impl_->gate_mutex);
  impl::gate_slot& slot = impl_->live_gate(gate, device, "destroy_gate");
  if (impl::word(gate).load(std::memory_order_acquire) != 1)
    throw backend_error("cuda: destroy_gate(" + dev_text(device) + ", gate " +
                        pointer_text(reinterpret_cast<void*>(gate)) + "): the gate is still closed (open it first)");
  slot.live = false;
  impl_->free_gates[static_cast<std::size_t>(device)].push_back(gate);
}

}  // namespace ccalloc
