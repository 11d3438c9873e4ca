// ccalloc as PyTorch's CUDA allocator: an implementation of
// c10::cuda::CUDACachingAllocator::CUDAAllocator over ccalloc's C API
// (include/ccalloc/ccalloc.h), built against the installed PyTorch by
// python/ccalloc/_build.py (at `pip install` when torch is importable, or on
// first use) and loaded by ccalloc.torch.install().
//
// Unlike a CUDAPluggableAllocator, this gives PyTorch everything its own
// allocator gives: statistics (torch.cuda.memory_stats and friends), OOM as
// torch.cuda.OutOfMemoryError, private pools for CUDA graphs, graph trees
// (torch.compile mode="reduce-overhead") and torch.cuda.MemPool,
// history for torch.cuda.memory._record_memory_history, trace trackers
// (ProcessGroupNCCL's registration hook), and CUDA IPC (torch.multiprocessing)
// of plain segments and of expandable segments' blocks.
//
// The C API is not linked: install(path) dlopens the libccalloc.so that the
// Python package loaded (one copy, one process-wide allocator) and looks up
// its functions. Every call goes to the process-wide allocator (NULL).
//
// Thread safety: as ccalloc's C API (any thread); install() once, from Python.
#include <ccalloc/ccalloc.h>

#include "torch_history.hpp"

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/extension.h>

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingAllocator::Stat;

// ---- the C API, looked up in the loaded libccalloc.so ---------------------------------------

#define CCALLOC_TORCH_FUNCTIONS(X)          \
  X(ccalloc_last_error)                     \
  X(ccalloc_version)                        \
  X(ccalloc_init)                           \
  X(ccalloc_initialized)                    \
  X(ccalloc_malloc)                         \
  X(ccalloc_delete)                         \
  X(ccalloc_record_stream)                  \
  X(ccalloc_get_base_allocation)            \
  X(ccalloc_empty_cache)                    \
  X(ccalloc_cache_info)                     \
  X(ccalloc_set_memory_fraction)            \
  X(ccalloc_get_memory_fraction)            \
  X(ccalloc_enable)                         \
  X(ccalloc_is_enabled)                     \
  X(ccalloc_stat_count)                     \
  X(ccalloc_stat_name)                      \
  X(ccalloc_get_device_stats)               \
  X(ccalloc_reset_accumulated_stats)        \
  X(ccalloc_reset_peak_stats)               \
  X(ccalloc_record_history)                 \
  X(ccalloc_history_options_init)           \
  X(ccalloc_record_history_ex)              \
  X(ccalloc_attach_out_of_memory_observer)  \
  X(ccalloc_attach_trace_tracker)           \
  X(ccalloc_attach_mapping_listener)        \
  X(ccalloc_create_pool)                    \
  X(ccalloc_create_pool_with_source)        \
  X(ccalloc_release_pool)                   \
  X(ccalloc_pool_use_count)                 \
  X(ccalloc_begin_allocate_to_pool_filter)  \
  X(ccalloc_end_allocate_to_pool)           \
  X(ccalloc_set_use_on_oom)                 \
  X(ccalloc_set_no_split)                   \
  X(ccalloc_check_pool_live_allocations)    \
  X(ccalloc_get_checkpoint_state)           \
  X(ccalloc_pool_checkpoint_destroy)        \
  X(ccalloc_set_checkpoint_pool_state)      \
  X(ccalloc_enable_peer_access)             \
  X(ccalloc_mapped_segments)                \
  X(ccalloc_share_ipc_handle_pidfd)         \
  X(ccalloc_open_ipc_handle_pidfd)          \
  X(ccalloc_close_ipc_handle)

struct api_table {
#define CCALLOC_TORCH_DECLARE(name) decltype(&::name) name = nullptr;
  CCALLOC_TORCH_FUNCTIONS(CCALLOC_TORCH_DECLARE)
#undef CCALLOC_TORCH_DECLARE
};

api_table api;

/// Loads the functions from the library at `path` (already loaded by the
/// Python package: dlopen hands back that copy). Throws naming what is missing.
void load_api(const std::string& path) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  TORCH_CHECK(handle != nullptr, "ccalloc: cannot load ", path, ": ", dlerror());
  api_table table;
#define CCALLOC_TORCH_LOOKUP(name)                                                                        \
  table.name = reinterpret_cast<decltype(table.name)>(dlsym(handle, #name));                              \
  TORCH_CHECK(table.name != nullptr, "ccalloc: ", path, " has no function " #name                         \
              " (a libccalloc.so older than this PyTorch integration; rebuild both from one checkout)");
  CCALLOC_TORCH_FUNCTIONS(CCALLOC_TORCH_LOOKUP)
#undef CCALLOC_TORCH_LOOKUP
  api = table;
}

/// Throws PyTorch's error for a failed C call: c10::OutOfMemoryError
/// (torch.cuda.OutOfMemoryError in Python) for out of memory, else c10::Error
/// (RuntimeError), both with ccalloc's message.
void check(ccalloc_status_t status) {
  if (status == CCALLOC_OK) return;
  const char* message = api.ccalloc_last_error();
  if (status == CCALLOC_ERROR_OUT_OF_MEMORY) TORCH_CHECK_WITH(OutOfMemoryError, false, message);
  if (status == CCALLOC_ERROR_INVALID_ARGUMENT) TORCH_CHECK_VALUE(false, message);
  TORCH_CHECK(false, message);
}

ccalloc_mempool_id_t to_pool(c10::MempoolId_t id) { return {id.first, id.second}; }

void free_pointer(void* ptr) {
  // A deleter cannot throw (PyTorch frees in destructors): report and go on.
  if (ptr != nullptr && api.ccalloc_delete(nullptr, ptr) != CCALLOC_OK)
    std::fprintf(stderr, "%s\n", api.ccalloc_last_error());
}

c10::DeviceIndex current_device() {
  c10::DeviceIndex device = 0;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  return device;
}

// ---- statistics: ccalloc's flat names -> PyTorch's DeviceStats --------------------------------

/// Where ccalloc's statistic `i` goes in DeviceStats (nullptr: nowhere).
struct stat_slot {
  Stat* stat = nullptr;        // a Stat field (with .current/.peak/.allocated/.freed)
  int64_t* plain = nullptr;    // a plain counter
  int field = 0;               // 0 current, 1 peak, 2 allocated, 3 freed
};

std::vector<stat_slot> map_stats(DeviceStats& out, const std::vector<std::string>& names) {
  const std::unordered_map<std::string_view, c10::CachingAllocator::StatArray*> arrays = {
      {"allocation", &out.allocation},         {"segment", &out.segment},
      {"active", &out.active},                 {"inactive_split", &out.inactive_split},
      {"allocated_bytes", &out.allocated_bytes}, {"reserved_bytes", &out.reserved_bytes},
      {"active_bytes", &out.active_bytes},     {"inactive_split_bytes", &out.inactive_split_bytes},
      {"requested_bytes", &out.requested_bytes}};
  const std::unordered_map<std::string_view, Stat*> singles = {
      {"oversize_allocations", &out.oversize_allocations}, {"oversize_segments", &out.oversize_segments}};
  const std::unordered_map<std::string_view, int64_t*> plains = {
      {"num_alloc_retries", &out.num_alloc_retries}, {"num_ooms", &out.num_ooms},
      {"num_sync_all_streams", &out.num_sync_all_streams}, {"num_device_alloc", &out.num_device_alloc},
      {"num_device_free", &out.num_device_free}, {"max_split_size", &out.max_split_size}};
  const std::unordered_map<std::string_view, int> fields = {
      {"current", 0}, {"peak", 1}, {"allocated", 2}, {"freed", 3}};
  const std::unordered_map<std::string_view, int> pools = {{"all", 0}, {"small_pool", 1}, {"large_pool", 2}};
  std::vector<stat_slot> slots(names.size());
  for (std::size_t i = 0; i < names.size(); ++i) {
    const std::string_view name = names[i];
    const auto dot = name.find('.');
    if (dot == std::string_view::npos) {
      if (auto it = plains.find(name); it != plains.end()) slots[i].plain = it->second;
      continue;
    }
    const std::string_view head = name.substr(0, dot);
    const std::string_view rest = name.substr(dot + 1);
    if (auto single = singles.find(head); single != singles.end()) {
      if (auto f = fields.find(rest); f != fields.end()) slots[i] = {single->second, nullptr, f->second};
      continue;
    }
    const auto dot2 = rest.find('.');
    auto array = arrays.find(head);
    if (array == arrays.end() || dot2 == std::string_view::npos) continue;
    auto pool = pools.find(rest.substr(0, dot2));
    auto f = fields.find(rest.substr(dot2 + 1));
    if (pool == pools.end() || f == fields.end()) continue;
    slots[i] = {&(*array->second)[static_cast<std::size_t>(pool->second)], nullptr, f->second};
  }
  return slots;
}

// ---- pools' segment sources and stream filters ---------------------------------------------------

/// A MemPool's allocator (e.g. a CUDAPluggableAllocator over ncclMemAlloc)
/// as a ccalloc segment source. Kept as long as the process (pools may
/// outlive every Python reference).
struct pool_source {
  std::shared_ptr<cca::CUDAAllocator> allocator;
};

int source_malloc(void* user_data, void** ptr, size_t size) {
  try {
    *ptr = static_cast<pool_source*>(user_data)->allocator->raw_alloc(size);
    return *ptr == nullptr ? 2 : 0;
  } catch (...) {
    return 2;  // ccalloc treats it as out of memory
  }
}

int source_free(void* user_data, void* ptr) {
  try {
    static_cast<pool_source*>(user_data)->allocator->raw_delete(ptr);
    return 0;
  } catch (...) {
    return 1;
  }
}

using torch_filter = std::function<bool(cudaStream_t)>;

int call_filter(void* user_data, ccalloc_stream_t stream) {
  try {  // nothing may cross the C API: a failing filter (a CUDA error) takes no stream
    return (*static_cast<torch_filter*>(user_data))(reinterpret_cast<cudaStream_t>(stream)) ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

void release_filter(void* user_data) { delete static_cast<torch_filter*>(user_data); }

/// A checkpoint as PyTorch's AllocatorState (CUDA graph trees keep it).
struct checkpoint_state final : cca::AllocatorState {
  ccalloc_pool_checkpoint_t* checkpoint = nullptr;
  c10::DeviceIndex device = 0;
  ~checkpoint_state() override { api.ccalloc_pool_checkpoint_destroy(checkpoint); }
};

// ---- OOM observers -----------------------------------------------------------------------------------

void call_oom_observer(void* user_data, int device, size_t requested, size_t allowed, size_t free_bytes) {
  // PyTorch's observer: (device, allocated bytes, device total, device free).
  (*static_cast<cca::OutOfMemoryObserver*>(user_data))(device, requested, allowed, free_bytes);
}

// ---- trace trackers (attachAllocatorTraceTracker) ------------------------------------------------------
//
// PyTorch's trackers (ProcessGroupNCCL's and torchcomms' registration hooks,
// the CUDA sanitizer) get TraceEntry values from two C callbacks:
//   - history entries (ALLOC, FREE_REQUESTED, FREE_COMPLETED, SNAPSHOT, OOM)
//     from ccalloc_attach_trace_tracker, after the allocator's locks are
//     released;
//   - changes of what is mapped from ccalloc_attach_mapping_listener, at the
//     change, under the device's locks: SEGMENT_ALLOC / SEGMENT_FREE for
//     plain segments, SEGMENT_MAP / SEGMENT_UNMAP for pages of expandable
//     segments; a SEGMENT_FREE or SEGMENT_UNMAP comes before the memory is
//     unmapped, so a hook that deregisters does so in time.
// The history's own segment entries are not forwarded (the mapping listener
// gives them, in time). A tracker that throws is skipped (ccalloc drops it).
// Trackers are kept for the life of the process (PyTorch cannot detach them).
struct trace_tracker_list {
  std::mutex mutex;
  std::shared_ptr<const std::vector<cca::AllocatorTraceTracker>> trackers;
};
trace_tracker_list& trace_trackers() {
  static auto* list = new trace_tracker_list;  // never destroyed: callbacks may run at exit
  return *list;
}

void deliver_trace_entry(cca::TraceEntry::Action action, int device, std::uintptr_t addr, std::size_t size,
                         ccalloc_stream_t stream) {
  std::shared_ptr<const std::vector<cca::AllocatorTraceTracker>> trackers;
  {
    std::lock_guard<std::mutex> lock(trace_trackers().mutex);
    trackers = trace_trackers().trackers;
  }
  if (!trackers) return;
  const cca::TraceEntry entry(action, static_cast<c10::DeviceIndex>(device), addr, size,
                              reinterpret_cast<cudaStream_t>(stream), c10::MempoolId_t{0, 0},
                              c10::getApproximateTime());
  for (const auto& tracker : *trackers) tracker(entry);
}

void forward_trace_entry(void* /*user_data*/, const ccalloc_trace_entry_t* e) {
  using action = cca::TraceEntry::Action;
  switch (e->action) {
    case CCALLOC_TRACE_ALLOC: return deliver_trace_entry(action::ALLOC, e->device, e->addr, e->size_bytes, e->stream);
    case CCALLOC_TRACE_FREE_REQUESTED:
      return deliver_trace_entry(action::FREE_REQUESTED, e->device, e->addr, e->size_bytes, e->stream);
    case CCALLOC_TRACE_FREE_COMPLETED:
      return deliver_trace_entry(action::FREE_COMPLETED, e->device, e->addr, e->size_bytes, e->stream);
    case CCALLOC_TRACE_SNAPSHOT:
      return deliver_trace_entry(action::SNAPSHOT, e->device, e->addr, e->size_bytes, e->stream);
    case CCALLOC_TRACE_OOM: return deliver_trace_entry(action::OOM, e->device, e->addr, e->size_bytes, e->stream);
    default: return;  // segment entries: from the mapping listener; empty_cache is not PyTorch's
  }
}

void forward_mapping_event(void* /*user_data*/, const ccalloc_mapping_event_t* e) {
  using action = cca::TraceEntry::Action;
  if (e->change == CCALLOC_MAPPING_MAP)
    deliver_trace_entry(e->expandable ? action::SEGMENT_MAP : action::SEGMENT_ALLOC, e->device, e->addr,
                        e->size_bytes, e->stream);
  else if (e->change == CCALLOC_MAPPING_UNMAP)
    deliver_trace_entry(e->expandable ? action::SEGMENT_UNMAP : action::SEGMENT_FREE, e->device, e->addr,
                        e->size_bytes, e->stream);
  // move and unmap_completed change no registration: PyTorch has no action for them
}

// ---- the allocator ------------------------------------------------------------------------------------

constexpr char ipc_handle_version = 2;  // PyTorch's shareable-handle format, plain cudaMalloc kind
constexpr char ipc_handle_cuda_malloc = 'c';
// A block of an expandable segment: ccalloc's own handle (share_ipc_handle_pidfd's
// bytes: the block's pages only, one stable handle per block, a lease that
// keeps the pages while an importer lives). Both processes must use ccalloc's
// integration; PyTorch's own allocator cannot open it.
constexpr char ipc_handle_ccalloc_expandable = 'x';

class ccalloc_cuda_allocator final : public cca::CUDAAllocator {
 public:
  ccalloc_cuda_allocator() {
    const std::size_t count = api.ccalloc_stat_count();
    for (std::size_t i = 0; i < count; ++i) stat_names_.emplace_back(api.ccalloc_stat_name(i));
  }

  // ---- c10::Allocator -----------------------------------------------------------------
  c10::DataPtr allocate(size_t size) override {
    const c10::DeviceIndex device = current_device();
    void* ptr = nullptr;
    if (size > 0) {
      const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
      check(api.ccalloc_malloc(nullptr, device, size, stream, &ptr));
    }
    return {ptr, ptr, &free_pointer, c10::Device(c10::DeviceType::CUDA, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pointer; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  // ---- DeviceAllocator --------------------------------------------------------------------
  bool initialized() override {
    int out = 0;
    return api.ccalloc_initialized(nullptr, &out) == CCALLOC_OK && out != 0;
  }
  void emptyCache(c10::MempoolId_t /*mempool_id*/) override { check(api.ccalloc_empty_cache(nullptr)); }
  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    std::vector<int64_t> values(stat_names_.size());
    check(api.ccalloc_get_device_stats(nullptr, device, values.data(), values.size()));
    DeviceStats out;
    const std::vector<stat_slot> slots = map_stats(out, stat_names_);
    for (std::size_t i = 0; i < slots.size(); ++i) {
      if (slots[i].plain != nullptr) *slots[i].plain = values[i];
      if (slots[i].stat == nullptr) continue;
      Stat& s = *slots[i].stat;
      (slots[i].field == 0 ? s.current : slots[i].field == 1 ? s.peak : slots[i].field == 2 ? s.allocated : s.freed) =
          values[i];
    }
    return out;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check(api.ccalloc_reset_accumulated_stats(nullptr, device));
  }
  void resetPeakStats(c10::DeviceIndex device) override { check(api.ccalloc_reset_peak_stats(nullptr, device)); }

  // ---- CUDAAllocator ------------------------------------------------------------------------
  void* raw_alloc(size_t size) override {
    return raw_alloc_with_stream(size, c10::cuda::getCurrentCUDAStream().stream());
  }
  void* raw_alloc_with_stream(size_t size, cudaStream_t stream) override {
    void* ptr = nullptr;
    if (size > 0) check(api.ccalloc_malloc(nullptr, current_device(), size, stream, &ptr));
    return ptr;
  }
  void raw_delete(void* ptr) override { check(api.ccalloc_delete(nullptr, ptr)); }
  void init(int device_count) override { check(api.ccalloc_init(nullptr, device_count)); }
  double getMemoryFraction(c10::DeviceIndex device) override {
    double out = 1.0;
    check(api.ccalloc_get_memory_fraction(nullptr, device, &out));
    return out;
  }
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    check(api.ccalloc_set_memory_fraction(nullptr, device, fraction));
  }
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex /*device*/) override {
    return {};  // not in the C API; PyTorch uses it only for its own expandable-segment tuning
  }
  void enable(bool value) override { check(api.ccalloc_enable(nullptr, value ? 1 : 0)); }
  bool isEnabled() const override {
    int out = 1;
    return api.ccalloc_is_enabled(nullptr, &out) != CCALLOC_OK || out != 0;
  }
  void cacheInfo(c10::DeviceIndex device, size_t* largest_block) override {
    check(api.ccalloc_cache_info(nullptr, device, largest_block));
  }
  void* getBaseAllocation(void* ptr, size_t* size) override {
    void* base = nullptr;
    size_t bytes = 0;
    check(api.ccalloc_get_base_allocation(nullptr, ptr, &base, &bytes));
    if (size != nullptr) *size = bytes;
    return base;
  }
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    if (ptr.get() == nullptr) return;
    check(api.ccalloc_record_stream(nullptr, ptr.get(), stream.stream()));
  }
  // The segments only: what ProcessGroupNCCL's register hook reads when a
  // communicator is made (TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK), one
  // entry per mapped range of an expandable reservation as PyTorch reports
  // its expandable segments. Blocks, traces and stack frames come from
  // torch.cuda.memory._snapshot(), which the Python package routes to
  // ccalloc's full snapshot.
  cca::SnapshotInfo snapshot(c10::MempoolId_t mempool_id, bool /*include_traces*/) override {
    size_t n = 0;
    check(api.ccalloc_mapped_segments(nullptr, -1, nullptr, &n));
    std::vector<ccalloc_mapped_segment_t> ranges(n + 16);  // room for segments made meanwhile
    n = ranges.size();
    check(api.ccalloc_mapped_segments(nullptr, -1, ranges.data(), &n));
    ranges.resize(std::min(n, ranges.size()));
    cca::SnapshotInfo out;
    const bool one_pool = mempool_id.first != 0 || mempool_id.second != 0;
    for (const ccalloc_mapped_segment_t& r : ranges) {
      using id_part = decltype(c10::MempoolId_t{}.first);
      const c10::MempoolId_t pool{static_cast<id_part>(r.pool_id.first), static_cast<id_part>(r.pool_id.second)};
      if (one_pool && pool != mempool_id) continue;
      auto& seg = out.segments.emplace_back();
      seg.device = static_cast<decltype(seg.device)>(r.device);
      seg.address = static_cast<decltype(seg.address)>(r.address);
      seg.total_size = r.total_bytes;
      seg.requested_size = r.requested_bytes;
      seg.allocated_size = r.allocated_bytes;
      seg.active_size = r.active_bytes;
      seg.is_large = r.is_large != 0;
      seg.is_expandable = r.is_expandable != 0;
      seg.owner_private_pool_id = pool;
      // The stream's field is a pointer (cudaStream_t or void*) in the
      // PyTorch releases this builds against; left at its default otherwise.
      [](auto& field, ccalloc_stream_t stream) {
        using field_t = std::remove_reference_t<decltype(field)>;
        if constexpr (std::is_pointer_v<field_t>) field = reinterpret_cast<field_t>(stream);
      }(seg.stream, r.stream);
    }
    return out;
  }

  // ---- private pools (CUDA graphs, MemPool) -----------------------------------------------------
  void beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t id,
                           std::function<bool(cudaStream_t)> filter) override {
    // PyTorch's own allocator creates the pool (or adds a user) here; the
    // matching releasePool drops it.
    check(api.ccalloc_create_pool(nullptr, device, to_pool(id), nullptr, nullptr));
    auto* owned = new torch_filter(std::move(filter));
    const ccalloc_status_t status =
        api.ccalloc_begin_allocate_to_pool_filter(nullptr, device, to_pool(id), &call_filter, owned, &release_filter);
    if (status != CCALLOC_OK) (void)api.ccalloc_release_pool(nullptr, device, to_pool(id));
    check(status);
  }
  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t id) override {
    check(api.ccalloc_end_allocate_to_pool(nullptr, device, to_pool(id)));
  }
  void releasePool(c10::DeviceIndex device, c10::MempoolId_t id) override {
    check(api.ccalloc_release_pool(nullptr, device, to_pool(id)));
  }
  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t id) override {
    int out = 0;
    check(api.ccalloc_pool_use_count(nullptr, device, to_pool(id), &out));
    return out;
  }
  void createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override {
    if (allocator == nullptr || allocator.get() == this) {
      check(api.ccalloc_create_pool(nullptr, device, to_pool(id), nullptr, nullptr));
      return;
    }
    auto* source = new pool_source{std::move(allocator)};  // lives as long as the process
    check(api.ccalloc_create_pool_with_source(nullptr, device, to_pool(id), &source_malloc, &source_free, source));
  }
  void setUseOnOOM(c10::DeviceIndex device, c10::MempoolId_t id, bool use_on_oom) override {
    check(api.ccalloc_set_use_on_oom(nullptr, device, to_pool(id), use_on_oom ? 1 : 0));
  }
  void setNoSplit(c10::DeviceIndex device, c10::MempoolId_t id) override {
    check(api.ccalloc_set_no_split(nullptr, device, to_pool(id), 1));
  }
  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::MempoolId_t id,
                                const std::unordered_set<void*>& expected) override {
    const std::vector<void*> ptrs(expected.begin(), expected.end());
    int out = 0;
    check(api.ccalloc_check_pool_live_allocations(nullptr, device, to_pool(id), ptrs.data(), ptrs.size(), &out));
    return out != 0;
  }
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device, c10::MempoolId_t id) override {
    auto state = std::make_shared<checkpoint_state>();
    state->device = device;
    check(api.ccalloc_get_checkpoint_state(nullptr, device, to_pool(id), &state->checkpoint));
    return state;
  }
  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                              std::shared_ptr<cca::AllocatorState> state) override {
    auto* cp = dynamic_cast<checkpoint_state*>(state.get());
    TORCH_CHECK(cp != nullptr, "ccalloc: setCheckpointPoolState was given a state that is not ccalloc's");
    struct collected {
      cca::CheckpointDelta delta;
      c10::DeviceIndex device;
    } out{{}, device};
    auto on_block = [](void* user_data, void* ptr, size_t /*size*/, int created) {
      auto* o = static_cast<collected*>(user_data);
      if (created != 0)
        o->delta.dataptrs_allocd.emplace_back(ptr, ptr, &free_pointer, c10::Device(c10::DeviceType::CUDA, o->device));
      else
        o->delta.ptrs_freed.push_back(ptr);
    };
    check(api.ccalloc_set_checkpoint_pool_state(nullptr, device, cp->checkpoint, on_block, &out));
    return std::move(out.delta);
  }

  // ---- CUDA IPC (plain segments; PyTorch's handle format, so either allocator opens it) ---------
  cca::ShareableHandle shareIpcHandle(void* ptr) override {
    // PyTorch passes a block's pointer or its segment's base (which may be
    // no live block): cudaIpcGetMemHandle wants the base either way.
    void* base = ptr;
    size_t size = 0;
    if (api.ccalloc_get_base_allocation(nullptr, ptr, &base, &size) != CCALLOC_OK) base = ptr;
    cudaIpcMemHandle_t handle;
    const cudaError_t err = cudaIpcGetMemHandle(&handle, base);
    if (err != cudaSuccess) {
      // Not cudaMalloc memory: a block of an expandable segment (pages of
      // cuMemCreate). PyTorch shares a storage by its data pointer, the
      // block's start: its handle is ccalloc's own handle of that block, at
      // offset 0 (getBaseAllocation's base is the whole reservation, which
      // is never shared).
      (void)cudaGetLastError();
      return {0, share_expandable(ptr, err)};
    }
    std::string text;
    text.push_back(ipc_handle_version);
    text.push_back(ipc_handle_cuda_malloc);
    text.append(reinterpret_cast<const char*>(&handle), sizeof handle);
    return {static_cast<char*>(ptr) - static_cast<char*>(base), std::move(text)};
  }
  std::shared_ptr<void> getIpcDevPtr(std::string text) override {
    const bool expandable =
        text.size() > 2 && text[0] == ipc_handle_version && text[1] == ipc_handle_ccalloc_expandable;
    TORCH_CHECK(expandable || (text.size() == 2 + sizeof(cudaIpcMemHandle_t) && text[0] == ipc_handle_version &&
                               text[1] == ipc_handle_cuda_malloc),
                "ccalloc: unknown CUDA IPC handle (", text.size(),
                " bytes): ccalloc opens plain segments (cudaIpcGetMemHandle) and its own handles of expandable "
                "segments");
    std::lock_guard<std::mutex> lock(ipc_mutex_);
    if (auto it = ipc_open_.find(text); it != ipc_open_.end())
      if (auto alive = it->second.lock()) return alive;
    if (expandable) {
      // The exporter's descriptors come through pidfd_getfd; the mapping
      // holds the block's pages (its lease) until the last tensor using it
      // here is gone.
      void* ptr = nullptr;
      check(api.ccalloc_open_ipc_handle_pidfd(nullptr, text.data() + 2, text.size() - 2, current_device(), &ptr));
      std::shared_ptr<void> out(ptr, [](void* p) {
        if (api.ccalloc_close_ipc_handle(nullptr, p) != CCALLOC_OK)
          std::fprintf(stderr, "%s\n", api.ccalloc_last_error());
      });
      ipc_open_[text] = out;
      return out;
    }
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, text.data() + 2, sizeof handle);
    void* ptr = nullptr;
    C10_CUDA_CHECK(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess));
    const int device = current_device();
    std::shared_ptr<void> out(ptr, [device](void* p) {
      c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
      (void)cudaIpcCloseMemHandle(p);
    });
    ipc_open_[text] = out;
    return out;
  }

  // shareIpcHandle's handle of the block at `ptr` (its start) in an
  // expandable segment: version, kind, then share_ipc_handle_pidfd's bytes
  // (the same for every share of the block). Throws naming the pointer and
  // why (cudaIpcGetMemHandle's error, then ccalloc's).
  std::string share_expandable(void* ptr, cudaError_t ipc_error) {
    std::size_t length = 0;
    if (api.ccalloc_share_ipc_handle_pidfd(nullptr, ptr, nullptr, 0, &length) != CCALLOC_OK)
      TORCH_CHECK(false, "ccalloc: cannot share ", ptr, " with another process: cudaIpcGetMemHandle failed (",
                  cudaGetErrorString(ipc_error), ") and ", api.ccalloc_last_error());
    std::string text(2 + length, '\0');
    text[0] = ipc_handle_version;
    text[1] = ipc_handle_ccalloc_expandable;
    std::size_t again = 0;
    check(api.ccalloc_share_ipc_handle_pidfd(nullptr, ptr, text.data() + 2, length, &again));
    TORCH_CHECK(again == length, "ccalloc: the IPC handle of ", ptr, " changed size while it was read (", length,
                " then ", again, " bytes)");
    return text;
  }

  // ---- history --------------------------------------------------------------------------------------------
  bool isHistoryEnabled() override { return history_.load(); }
  void recordHistory(bool enabled, cca::CreateContextFn context_recorder, size_t max_entries,
                     cca::RecordContext when, bool clear_history,
                     const std::vector<std::string>& skip_actions) override {
    ccalloc_history_options_t o;
    api.ccalloc_history_options_init(&o);
    o.enabled = enabled ? 1 : 0;
    o.max_entries = max_entries == 0 ? 1 : max_entries;
    o.when = static_cast<int>(when);  // RecordContext NEVER..ALL = ccalloc_record_context_t 0..3
    o.clear = clear_history ? 1 : 0;
    const std::string skip = ccalloc_torch::join_actions(skip_actions);
    o.skip_actions = skip.empty() ? nullptr : skip.c_str();
    if (enabled && context_recorder != nullptr) {
      // Kept for the process: handles recorded under it may outlive any later call.
      o.user_data = new cca::CreateContextFn(context_recorder);
      o.record = &ccalloc_torch::record_context;
      o.release = &ccalloc_torch::release_context;
      o.frames = &ccalloc_torch::context_frames;
    }
    check(api.ccalloc_record_history_ex(nullptr, &o));
    history_.store(enabled);
  }
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    auto* kept = new cca::OutOfMemoryObserver(std::move(observer));  // observers cannot be detached
    check(api.ccalloc_attach_out_of_memory_observer(nullptr, &call_oom_observer, kept));
  }
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override {
    // See "trace trackers" above: the C callbacks are attached with the first tracker.
    bool first = false;
    {
      std::lock_guard<std::mutex> lock(trace_trackers().mutex);
      const auto& now = trace_trackers().trackers;
      auto next = now ? std::make_shared<std::vector<cca::AllocatorTraceTracker>>(*now)
                      : std::make_shared<std::vector<cca::AllocatorTraceTracker>>();
      next->push_back(std::move(tracker));
      first = !now;
      trace_trackers().trackers = std::move(next);
    }
    if (first) {
      check(api.ccalloc_attach_trace_tracker(nullptr, &forward_trace_entry, nullptr));
      check(api.ccalloc_attach_mapping_listener(nullptr, &forward_mapping_event, nullptr));
    }
  }
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    check(api.ccalloc_enable_peer_access(nullptr, dev, dev_to_access));
  }
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dst_device == src_device)
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
  }
  std::string name() override { return "ccalloc"; }

 private:
  std::vector<std::string> stat_names_;
  std::atomic<bool> history_{false};
  std::mutex ipc_mutex_;
  std::unordered_map<std::string, std::weak_ptr<void>> ipc_open_;
};

std::shared_ptr<ccalloc_cuda_allocator> installed;

/// Makes ccalloc PyTorch's CUDA allocator. `library` is the path of the
/// libccalloc.so the Python package loaded. Raises RuntimeError when
/// PyTorch's allocator is in use already (CUDA initialized).
void install(const std::string& library) {
  if (installed != nullptr) return;
  load_api(library);
  auto allocator = std::make_shared<ccalloc_cuda_allocator>();
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(allocator);
  installed = std::move(allocator);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ccalloc as PyTorch's CUDA allocator (c10::cuda::CUDACachingAllocator::CUDAAllocator)";
  m.def("install", &install, pybind11::arg("library"),
        "Makes ccalloc (the libccalloc.so at `library`) PyTorch's CUDA allocator; before CUDA is used.");
  m.def("is_installed", [] { return installed != nullptr; });
  // torch.__version__ is part of the build's directory name (ccalloc/_build.py: key).
}
